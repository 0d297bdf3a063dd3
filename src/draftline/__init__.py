"""draftline: EAGLE-3 drafters from verifier outputs, finetuned with DeepSpeed, shipped through the MLflow registry."""
__version__ = "0.1.0"
