"""Drafters measured on a fixed evaluation set: teacher-forced (``teacher_forced``), by real greedy chain
speculative decoding against the verifier (``chain``, or a vLLM server: ``vllm_backend``), the evaluate stage
(``stage``), and the results read back for export and promotion (``results``)."""
