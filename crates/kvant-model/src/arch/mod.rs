//! Architectures. The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2/3,
//! Gemma 3) is one implementation with switches from [`crate::config::ModelConfig`].

pub mod llama;
