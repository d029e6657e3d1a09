//! GGUF v2/v3 reader over an mmap: metadata, tensor infos, typed tensor views.
