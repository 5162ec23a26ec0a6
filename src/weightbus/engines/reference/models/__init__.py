"""Model definitions of the reference engine: configs, the Llama/Qwen2 decoder, HF loading."""
