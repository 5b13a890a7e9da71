"""Runtimes for models that are not LLMs: the sentence-embedding encoder process and scikit-learn / XGBoost / ONNX
predictors, each with its dynamic batcher."""
