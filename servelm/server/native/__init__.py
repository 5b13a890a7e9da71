"""servelm's native endpoints: /generate, /chat and /v1/feedback."""
