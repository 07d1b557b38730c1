"""File formats: GGUF reading, block quantization, the tokenizer, chat templates."""
