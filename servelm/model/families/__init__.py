"""Model families over the shared decoder (Gemma, Phi-3, mixture-of-experts) and the BERT-family sentence encoder."""
