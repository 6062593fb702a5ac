"""Serving forwards: dense targets (Llama, Qwen3) and the DFlash drafter."""
