"""Modules vLLM imports itself (by module path, with this folder on its PYTHONPATH): they import vLLM and torch, never draftline."""
