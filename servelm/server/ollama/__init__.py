"""Ollama's API (/api/generate, /api/chat, /api/embed, /api/show, ...): its request bodies and routes."""
