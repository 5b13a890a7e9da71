"""What runs before any route: the ASGI gateway, API keys, rate limits, admission and the request-head timeout."""
