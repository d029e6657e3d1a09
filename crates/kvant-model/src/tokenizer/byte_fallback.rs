//! SentencePiece byte tokens: "<0xXX>" spells one raw byte, used for characters the vocabulary
//! lacks.

pub(crate) fn byte_token(byte: u8) -> String {
    format!("<0x{byte:02X}>")
}

/// The byte a "<0xXX>" token spells.
pub(crate) fn parse_byte_token(token: &str) -> Option<u8> {
    let hex = token.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_tokens_round_trip() {
        for b in 0..=255u8 {
            assert_eq!(parse_byte_token(&byte_token(b)), Some(b));
        }
        assert_eq!(parse_byte_token("<0x0a>"), Some(10));
        assert_eq!(parse_byte_token("<0x1>"), None);
        assert_eq!(parse_byte_token("<0x+1>"), None);
        assert_eq!(parse_byte_token("0x41"), None);
    }
}
