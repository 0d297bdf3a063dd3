"""What ``draftline make-tiny`` builds: the tiny verifier and parent (``tiny``) and the Kimi-shaped tiny verifier
(``kimi``, ``kimi_k25``, custom code in ``kimi_code/``). Only the CLI's ``stages`` imports it; the rest of the test
kit (fake servers, fixtures) is ``tests/kit``, outside the product (``tests/unit/project/test_architecture.py``)."""
