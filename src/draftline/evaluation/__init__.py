"""Drafters measured on a fixed evaluation set: teacher-forced (``teacher_forced``), by real greedy chain
speculative decoding against the verifier (``chain``, or a vLLM server: ``vllm_backend``, ``loopback``), the
speed a drafter buys (``speed``), what the serving fleet sees (``observe``) and the evaluate stage (``stage``);
the evidence export and promotion read back lives in :mod:`draftline.registry.evidence`."""
