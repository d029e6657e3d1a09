//! What a tokenizer builder makes: the encoding engine, the decoding
//! table, who adds BOS/EOS, and the special ids, from which
//! [`super::Tokenizer`] is assembled.

use super::pieces::PieceTable;

/// One format's tokenizer, before it is wrapped for use.
pub(super) struct Parts {
    pub engine: tokenizers::Tokenizer,
    pub pieces: PieceTable,
    pub add_special: AddSpecial,
    pub bos: Option<u32>,
    pub eos: Vec<u32>,
    /// What kind of tokenizer this is, for `kvant info`.
    pub kind: String,
}

/// Who adds BOS/EOS when `encode` is asked for special tokens.
pub(super) enum AddSpecial {
    /// GGUF: kvant adds them as `tokenizer.ggml.add_{bos,eos}_token` say.
    Manual { bos: Option<u32>, eos: Option<u32> },
    /// tokenizer.json: its post-processor does; `adds_bos` records whether that includes BOS.
    PostProcessor { adds_bos: bool },
}
