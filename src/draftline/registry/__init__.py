"""The MLflow Model Registry side: versions, lineage, evidence, policies, promotion, verified transfers."""
