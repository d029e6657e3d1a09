//! A Hugging Face model directory: `config.json`, the weights (one
//! `model.safetensors` or shards listed by `model.safetensors.index.json`),
//! and the optional tokenizer and generation files.

use super::error::{HfError, Result};
use super::files::{read_json_object, read_optional_json, read_optional_text};
use super::index::{read_weight_map, INDEX_FILE};
use super::safetensors::SafetensorsFile;
use kvant_core::Tensor;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub const CONFIG_FILE: &str = "config.json";
pub const WEIGHTS_FILE: &str = "model.safetensors";
pub const TOKENIZER_FILE: &str = "tokenizer.json";
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";
pub const GENERATION_CONFIG_FILE: &str = "generation_config.json";
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";

/// An opened model directory. Each weight file is mapped once; tensors are
/// views into those maps.
pub struct HfDir {
    dir: PathBuf,
    config: serde_json::Value,
    shards: Vec<SafetensorsFile>,
    /// Tensor name to index in `shards`.
    tensor_shard: BTreeMap<String, usize>,
    tokenizer_json: Option<PathBuf>,
    tokenizer_config: Option<serde_json::Value>,
    generation_config: Option<serde_json::Value>,
    chat_template: Option<String>,
}

impl HfDir {
    pub fn open(dir: &Path) -> Result<HfDir> {
        let config_path = dir.join(CONFIG_FILE);
        if !config_path.exists() {
            return Err(HfError::MissingFile {
                dir: dir.to_path_buf(),
                name: CONFIG_FILE,
            });
        }
        let config = read_json_object(&config_path, "config.json")?;
        let shards = open_weights(dir)?;
        let tensor_shard = index_tensors(&shards)?;
        let tokenizer_path = dir.join(TOKENIZER_FILE);
        Ok(HfDir {
            dir: dir.to_path_buf(),
            config,
            shards,
            tensor_shard,
            tokenizer_json: tokenizer_path.exists().then_some(tokenizer_path),
            tokenizer_config: read_optional_json(
                &dir.join(TOKENIZER_CONFIG_FILE),
                "tokenizer_config.json",
            )?,
            generation_config: read_optional_json(
                &dir.join(GENERATION_CONFIG_FILE),
                "generation_config.json",
            )?,
            chat_template: read_optional_text(&dir.join(CHAT_TEMPLATE_FILE))?,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `config.json`, kept as JSON: architectures read the keys they need.
    pub fn config(&self) -> &serde_json::Value {
        &self.config
    }

    /// Tensor names in sorted order.
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.tensor_shard.keys().map(String::as_str)
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.tensor_shard.contains_key(name)
    }

    /// Drops this process's resident pages of every weight file (see
    /// [`kvant_core::Storage::release_all_resident_pages`]).
    #[cfg(unix)]
    pub fn release_resident_pages(&self) {
        self.shards.iter().for_each(|s| s.release_resident_pages());
    }

    /// Tensor `name`: a view in its stored type, borrowing the mapped
    /// file; a block-scaled FP8 or FP4 weight assembled with its scale
    /// into kvant's block type (see [`super::scaled`]).
    pub fn tensor(&self, name: &str) -> Result<Tensor> {
        let shard = self.shard_of(name)?;
        let raw = shard.raw(name)?;
        let scale = || -> Option<Result<super::scaled::Raw<'_>>> {
            let scale_name = super::scaled::scale_names(name)
                .into_iter()
                .find(|s| self.has_tensor(s))?;
            Some(self.shard_of(&scale_name).and_then(|f| f.raw(&scale_name)))
        };
        match raw.dtype {
            "F8_E4M3" => {
                let scale = scale().ok_or_else(|| HfError::ScaledWeight {
                    tensor: name.to_string(),
                    reason: format!(
                        "an F8_E4M3 weight needs its block scales ({})",
                        super::scaled::scale_names(name).join(" or ")
                    ),
                })??;
                super::scaled::fp8(name, raw, scale)
            }
            "I8" | "U8" | "F4" => match scale() {
                Some(scale) => super::scaled::fp4(name, raw, scale?),
                None => shard.tensor(name),
            },
            _ => shard.tensor(name),
        }
    }

    /// Tensor `name`'s integer values and shape (see
    /// [`super::safetensors::SafetensorsFile::integers`]).
    pub fn integers(&self, name: &str) -> Result<(Vec<i64>, Vec<usize>)> {
        self.shard_of(name)?.integers(name)
    }

    /// The weight file that holds tensor `name`.
    fn shard_of(&self, name: &str) -> Result<&SafetensorsFile> {
        self.tensor_shard
            .get(name)
            .and_then(|&i| self.shards.get(i))
            .ok_or_else(|| HfError::MissingTensor {
                name: name.to_string(),
            })
    }

    pub fn tokenizer_json_path(&self) -> Option<&Path> {
        self.tokenizer_json.as_deref()
    }

    pub fn tokenizer_config(&self) -> Option<&serde_json::Value> {
        self.tokenizer_config.as_ref()
    }

    pub fn generation_config(&self) -> Option<&serde_json::Value> {
        self.generation_config.as_ref()
    }

    /// The contents of `chat_template.jinja`, which newer checkpoints ship
    /// instead of a `chat_template` entry in `tokenizer_config.json`.
    pub fn chat_template_file(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }
}

/// Maps the single weights file or every shard the index names (each once),
/// preferring the single file as transformers does.
fn open_weights(dir: &Path) -> Result<Vec<SafetensorsFile>> {
    let single = dir.join(WEIGHTS_FILE);
    if single.exists() {
        return Ok(vec![SafetensorsFile::open(&single)?]);
    }
    let index_path = dir.join(INDEX_FILE);
    if !index_path.exists() {
        return Err(HfError::NoWeights {
            dir: dir.to_path_buf(),
        });
    }
    let weight_map = read_weight_map(&index_path)?;
    let mut shards: BTreeMap<&str, SafetensorsFile> = BTreeMap::new();
    for shard in weight_map.values() {
        if shards.contains_key(shard.as_str()) {
            continue;
        }
        let path = dir.join(shard);
        if !path.exists() {
            return Err(HfError::MissingShard {
                index: index_path.clone(),
                shard: shard.clone(),
            });
        }
        shards.insert(shard, SafetensorsFile::open(&path)?);
    }
    for (tensor, shard) in &weight_map {
        if !shards
            .get(shard.as_str())
            .is_some_and(|f| f.contains(tensor))
        {
            return Err(HfError::NotInShard {
                index: index_path.clone(),
                tensor: tensor.clone(),
                shard: shard.clone(),
            });
        }
    }
    Ok(shards.into_values().collect())
}

/// Every tensor of every shard, each name in exactly one shard.
fn index_tensors(shards: &[SafetensorsFile]) -> Result<BTreeMap<String, usize>> {
    let mut out: BTreeMap<String, usize> = BTreeMap::new();
    for (i, shard) in shards.iter().enumerate() {
        for name in shard.names() {
            if let Some(&first) = out.get(name) {
                let first = shards
                    .get(first)
                    .map(SafetensorsFile::path)
                    .unwrap_or(shard.path());
                return Err(HfError::DuplicateTensor {
                    tensor: name.to_string(),
                    first: first.to_path_buf(),
                    second: shard.path().to_path_buf(),
                });
            }
            out.insert(name.to_string(), i);
        }
    }
    Ok(out)
}
