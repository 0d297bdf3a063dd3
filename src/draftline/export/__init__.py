"""export: a finetune checkpoint -> a directory vLLM serves as it is, registered as a version."""
