"""Serving: real vLLM, run as a loopback server from its own venv (``./setup.sh --vllm`` builds ``.venv-vllm``)
and spoken to over HTTP, as a deployment is. Its pins never meet MLflow's or DeepSpeed's."""
