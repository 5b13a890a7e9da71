"""OpenAI's API: request schemas and the error shape, /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/responses,
/v1/models, /tokenize, tool calls and logprobs."""
