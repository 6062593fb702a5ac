"""OpenAI-compatible HTTP frontend for the DDTree ensemble (see README.md in this directory)."""
