//! Tokenizers built from GGUF metadata or tokenizer.json, and incremental detokenization.
