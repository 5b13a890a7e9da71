"""Anthropic's Messages API, for clients built on Anthropic's SDK."""
