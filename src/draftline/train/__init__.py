"""finetune: build the EAGLE-3 drafter, load the parent, train it with DeepSpeed ZeRO."""
