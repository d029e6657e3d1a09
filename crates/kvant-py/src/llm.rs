//! `kvant.LLM`: load a checkpoint and generate, or stream, from Python.
//!
//! Loading and generation run with the GIL released. A stream runs the
//! generation on its own thread and hands text pieces to the Python
//! iterator through a channel; each piece arrives as soon as it is whole
//! UTF-8 and cannot be part of a stop string (the CLI's rule).

use kvant_engine::continuation::MIN_TOKENS;
use kvant_engine::sampling::SamplingParams;
use kvant_engine::session::{GenerateOutput, Session};
use kvant_engine::EngineRequest;
use kvant_model::arch::decoder::LoadOptions;
use kvant_model::chat::ChatMessage;
use kvant_model::load::{load_with, LoadedModel};
use pyo3::exceptions::{PyRuntimeError, PyStopIteration, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::path::PathBuf;
use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Mutex};

fn err(e: impl std::fmt::Display) -> PyErr {
    PyRuntimeError::new_err(e.to_string())
}

/// A loaded model with its tokenizer and chat template.
#[pyclass(name = "LLM", module = "kvant", frozen)]
pub struct Llm {
    m: Arc<LoadedModel>,
}

/// What one `generate` call asks for.
#[derive(Clone)]
struct Ask {
    prompt_ids: Vec<u32>,
    req: EngineRequest,
}

fn run(m: &LoadedModel, ask: &Ask, on_text: &mut dyn FnMut(&str)) -> PyResult<GenerateOutput> {
    let capacity = (ask.prompt_ids.len() + ask.req.max_tokens + 1).min(m.info.context_length);
    let mut session = Session::new(&m.model, &m.tokenizer, capacity).map_err(err)?;
    session.generate(&ask.req, on_text).map_err(err)
}

#[pymethods]
impl Llm {
    /// Loads a GGUF file or a Hugging Face directory (config.json,
    /// safetensors, tokenizer.json).
    #[new]
    #[pyo3(signature = (path, context_length = None))]
    fn new(py: Python<'_>, path: PathBuf, context_length: Option<usize>) -> PyResult<Self> {
        let opts = LoadOptions {
            context_length,
            ..LoadOptions::default()
        };
        let m = py
            .detach(|| load_with(&path, opts).map_err(|e| e.to_string()))
            .map_err(|e| PyValueError::new_err(format!("{}: {e}", path.display())))?;
        Ok(Llm { m: Arc::new(m) })
    }

    /// Token ids of `text` (with the tokenizer's BOS when `add_special`).
    #[pyo3(signature = (text, add_special = true))]
    fn tokenize(&self, text: &str, add_special: bool) -> PyResult<Vec<u32>> {
        self.m.tokenizer.encode(text, add_special).map_err(err)
    }

    #[pyo3(signature = (ids, skip_special = true))]
    fn detokenize(&self, ids: Vec<u32>, skip_special: bool) -> PyResult<String> {
        self.m.tokenizer.decode(&ids, skip_special).map_err(err)
    }

    /// The chat template applied to `messages` (a list of
    /// `{"role": ..., "content": ...}`), ready to generate from.
    fn apply_chat_template(&self, messages: Vec<Bound<'_, PyDict>>) -> PyResult<String> {
        let msgs = messages
            .iter()
            .map(|d| {
                let get = |k: &str| -> PyResult<String> {
                    d.get_item(k)?
                        .ok_or_else(|| PyValueError::new_err(format!("a message has no {k:?}")))?
                        .extract()
                };
                Ok(ChatMessage::new(get("role")?, get("content")?))
            })
            .collect::<PyResult<Vec<_>>>()?;
        let t = self.m.chat_template.as_ref().ok_or_else(|| {
            PyValueError::new_err("this checkpoint has no chat template; use generate()")
        })?;
        t.render(&msgs, true).map_err(err)
    }

    /// The continuation of `prompt` (plain text; use `apply_chat_template`
    /// for a conversation), as a string.
    #[pyo3(signature = (prompt, max_tokens = 128, temperature = 0.0, top_k = 0, top_p = 1.0, min_p = 0.0, seed = 0, stop = Vec::new()))]
    #[allow(clippy::too_many_arguments)]
    fn generate(
        &self,
        py: Python<'_>,
        prompt: &str,
        max_tokens: usize,
        temperature: f32,
        top_k: usize,
        top_p: f32,
        min_p: f32,
        seed: u64,
        stop: Vec<String>,
    ) -> PyResult<String> {
        let ask = self.ask(
            prompt,
            max_tokens,
            temperature,
            top_k,
            top_p,
            min_p,
            seed,
            stop,
        )?;
        let m = &self.m;
        let out = py.detach(|| run(m, &ask, &mut |_| {}))?;
        Ok(out.text)
    }

    /// As `generate`, but an iterator over text pieces as they are made.
    #[pyo3(signature = (prompt, max_tokens = 128, temperature = 0.0, top_k = 0, top_p = 1.0, min_p = 0.0, seed = 0, stop = Vec::new()))]
    #[allow(clippy::too_many_arguments)]
    fn stream(
        &self,
        prompt: &str,
        max_tokens: usize,
        temperature: f32,
        top_k: usize,
        top_p: f32,
        min_p: f32,
        seed: u64,
        stop: Vec<String>,
    ) -> PyResult<TextStream> {
        let ask = self.ask(
            prompt,
            max_tokens,
            temperature,
            top_k,
            top_p,
            min_p,
            seed,
            stop,
        )?;
        let (tx, rx) = channel::<Result<String, String>>();
        let m = Arc::clone(&self.m);
        std::thread::Builder::new()
            .name("kvant-stream".into())
            .spawn(move || {
                // A dropped iterator closes the channel; the pieces still
                // made until the generation ends are discarded.
                let r = run(&m, &ask, &mut |s| drop(tx.send(Ok(s.to_string()))));
                if let Err(e) = r {
                    drop(tx.send(Err(e.to_string())));
                }
            })
            .map_err(err)?;
        Ok(TextStream {
            rx: Some(Mutex::new(rx)),
        })
    }

    /// The model's description (what `kvant info` prints), as a dict.
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let i = &self.m.info;
        let d = PyDict::new(py);
        d.set_item("format", i.format)?;
        d.set_item("architecture", i.architecture)?;
        d.set_item("parameters", i.parameters)?;
        d.set_item("context_length", i.context_length)?;
        d.set_item("hidden_size", i.hidden_size)?;
        d.set_item("layers", i.layers)?;
        d.set_item("vocab_size", i.vocab_size)?;
        d.set_item("chat_template", i.chat_template)?;
        Ok(d)
    }
}

impl Llm {
    #[allow(clippy::too_many_arguments)]
    fn ask(
        &self,
        prompt: &str,
        max_tokens: usize,
        temperature: f32,
        top_k: usize,
        top_p: f32,
        min_p: f32,
        seed: u64,
        stop: Vec<String>,
    ) -> PyResult<Ask> {
        let sampling = SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            seed,
            ..SamplingParams::default()
        };
        sampling
            .validate()
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        if max_tokens < MIN_TOKENS {
            return Err(PyValueError::new_err(format!(
                "max_tokens must be at least {MIN_TOKENS}"
            )));
        }
        let prompt_ids = self.m.tokenizer.encode(prompt, true).map_err(err)?;
        let context = self.m.info.context_length;
        if prompt_ids.is_empty() || prompt_ids.len() >= context {
            return Err(PyValueError::new_err(format!(
                "the prompt has {} tokens; the context holds {context} (prompt and one generated token)",
                prompt_ids.len()
            )));
        }
        let max_tokens = max_tokens.min(context - prompt_ids.len());
        Ok(Ask {
            req: EngineRequest {
                stop,
                ..EngineRequest::new(prompt_ids.clone(), max_tokens, sampling)
            },
            prompt_ids,
        })
    }
}

/// The iterator `LLM.stream` returns.
#[pyclass(module = "kvant")]
pub struct TextStream {
    /// Behind a lock only because a pyclass must be `Sync`; one Python
    /// thread at a time iterates.
    rx: Option<Mutex<Receiver<Result<String, String>>>>,
}

#[pymethods]
impl TextStream {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&mut self, py: Python<'_>) -> PyResult<String> {
        let Some(rx) = &self.rx else {
            return Err(PyStopIteration::new_err(()));
        };
        let next = py.detach(|| match rx.lock() {
            Ok(rx) => rx.recv().ok(),
            Err(_) => None,
        });
        match next {
            Some(Ok(piece)) => Ok(piece),
            Some(Err(e)) => {
                self.rx = None;
                Err(PyRuntimeError::new_err(e))
            }
            None => {
                self.rx = None;
                Err(PyStopIteration::new_err(()))
            }
        }
    }
}
