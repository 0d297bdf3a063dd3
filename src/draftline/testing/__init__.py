"""The test kit: a tiny verifier and parent built locally, and loopback servers (an OpenAI-compatible server for
the tiny verifier, a real ``mlflow server``). For tests, benchmarks and the demo (``draftline make-tiny``);
nothing else in draftline imports it (``tests/unit/test_architecture.py`` holds that)."""
