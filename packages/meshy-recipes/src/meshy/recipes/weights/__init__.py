"""Model weights from outside a run: HF directories and the hub (pretrained, hub), GGUF files (gguf)."""
