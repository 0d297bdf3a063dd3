"""prepare: conversations -> tokens + loss masks -> verifier hidden states -> safetensors shards."""
