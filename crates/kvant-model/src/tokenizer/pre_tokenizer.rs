//! How a byte-level BPE vocabulary splits text before merging, chosen by `tokenizer.ggml.pre` the
//! way llama.cpp chooses it (`llm_tokenizer_bpe` in llama-vocab.cpp): a list of regexes applied in
//! turn, each splitting every piece the previous one left, matches and the text between them
//! both kept. The regexes are llama.cpp's, which spell case-insensitive contractions as explicit
//! classes so that Unicode case folding cannot change the split.
//!
//! Unknown names are an error: a wrong split silently produces token ids the model never saw.

use super::error::TokenizerError;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::Split;
use tokenizers::{PreTokenizerWrapper, SplitDelimiterBehavior};

const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";

const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const DEEPSEEK3_WORDS: &str = r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##;

/// A pre-tokenizer family: its regexes and the defaults llama.cpp sets with it.
#[derive(Debug, PartialEq)]
pub struct BpeSplit {
    pub(crate) regexes: &'static [&'static str],
    /// Take a whole pre-token that is itself in the vocabulary without merging (Llama 3).
    pub(crate) ignore_merges: bool,
    /// Add BOS when `tokenizer.ggml.add_bos_token` is absent.
    pub(crate) add_bos: bool,
}

const DEFAULT: BpeSplit = BpeSplit {
    regexes: &[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
    ignore_merges: false,
    add_bos: false,
};

/// Resolves `tokenizer.ggml.pre`; a missing key means llama.cpp's "default".
pub(crate) fn bpe_split(pre: Option<&str>) -> Result<BpeSplit, TokenizerError> {
    let split = |regexes, ignore_merges, add_bos| BpeSplit {
        regexes,
        ignore_merges,
        add_bos,
    };
    Ok(match pre.unwrap_or("default") {
        "default" => DEFAULT,
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" | "jina-v5-nano" => split(&[LLAMA3], true, true),
        "dbrx" | "smaug-bpe" => split(&[LLAMA3], false, false),
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" | "stablelm2" | "hunyuan"
        | "solar-open" => split(&[QWEN2], false, false),
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b"
        | "mellum2" => split(&[r"\p{N}", GPT2], false, false),
        "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es" | "jina-v2-de"
        | "a.x-4.0" | "mellum" | "modern-bert" | "mpt" | "olmo" | "jais" | "trillion"
        | "granite-docling" | "exaone4" => split(&[GPT2], false, false),
        "deepseek-v3" | "hunyuan-dense" | "joyai-llm" | "hy_v4" => split(
            &[r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+", DEEPSEEK3_WORDS],
            false,
            false,
        ),
        other => return Err(TokenizerError::UnknownPreTokenizer(other.to_string())),
    })
}

impl BpeSplit {
    /// The regexes as a tokenizers pre-tokenizer (before the byte-level mapping).
    pub(crate) fn pre_tokenizer(&self) -> Result<Vec<PreTokenizerWrapper>, TokenizerError> {
        self.regexes
            .iter()
            .map(|re| {
                let pattern =
                    tokenizers::pre_tokenizers::split::SplitPattern::Regex((*re).to_string());
                Split::new(pattern, SplitDelimiterBehavior::Isolated, false)
                    .map(PreTokenizerWrapper::Split)
                    .map_err(TokenizerError::Engine)
            })
            .collect()
    }
}

/// Wraps `steps` as one pre-tokenizer.
pub(crate) fn sequence(steps: Vec<PreTokenizerWrapper>) -> PreTokenizerWrapper {
    PreTokenizerWrapper::Sequence(Sequence::new(steps))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

    fn pieces(pre: &str, text: &str) -> Vec<String> {
        let split = bpe_split(Some(pre)).expect("known pre-tokenizer");
        let pre_tokenizer = sequence(split.pre_tokenizer().expect("regexes compile"));
        let mut s = PreTokenizedString::from(text);
        pre_tokenizer.pre_tokenize(&mut s).expect("pre-tokenize");
        s.get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(piece, _, _)| piece.to_string())
            .collect()
    }

    // Expected splits worked out by hand from llama.cpp's regexes.
    #[test]
    fn families_split_digits_and_spaces_as_llama_cpp() {
        let text = "Hello  world123456 it's";
        assert_eq!(
            pieces("llama-bpe", text),
            ["Hello", " ", " world", "123", "456", " it", "'s"]
        );
        assert_eq!(
            pieces("qwen2", text),
            ["Hello", " ", " world", "1", "2", "3", "4", "5", "6", " it", "'s"]
        );
        assert_eq!(
            pieces("gpt-2", text),
            ["Hello", " ", " world", "123456", " it", "'s"]
        );
        assert_eq!(
            pieces("smollm", text),
            ["Hello", " ", " world", "1", "2", "3", "4", "5", "6", " it", "'s"]
        );
        assert_eq!(
            pieces("default", text),
            ["Hello", " ", " world", "123", "456", " it", "'", "s"]
        );
        assert_eq!(
            pieces("deepseek-v3", "abc123456 中文字"),
            ["abc", "123", "456", " ", "中文字"]
        );
        // A whitespace run before a digit: the digit split leaves the run whole.
        assert_eq!(pieces("smollm", "x  1"), ["x", "  ", "1"]);
        assert_eq!(pieces("gpt-2", "x  1"), ["x", " ", " 1"]);
    }

    #[test]
    fn unknown_names_are_refused() {
        assert!(matches!(
            bpe_split(Some("mystery")),
            Err(TokenizerError::UnknownPreTokenizer(name)) if name == "mystery"
        ));
        assert_eq!(bpe_split(None).expect("default"), DEFAULT);
    }
}
