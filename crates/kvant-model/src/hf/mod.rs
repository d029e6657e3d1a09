//! Hugging Face model directories: config.json, (sharded) safetensors, tokenizer files.
