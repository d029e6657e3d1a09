//! GPT-2's byte-level alphabet: every byte is spelled as one printable character, so a byte-level
//! BPE vocabulary holds only printable strings ("Ġ" is the space byte 0x20).
//!
//! Bytes that are already printable (`!`..=`~`, `¡`..=`¬`, `®`..=`ÿ`) stand for themselves; the
//! other 68 are moved, in increasing order, to U+0100 upwards.

/// Number of characters in the spelled alphabet's range: 256 plus the 68 moved bytes.
const SPELLED_RANGE: usize = 256 + 68;

const fn stands_for_itself(b: usize) -> bool {
    matches!(b, 33..=126 | 161..=172 | 174..=255)
}

/// `BYTE_OF[c]` is the byte character `c` spells, or -1.
const BYTE_OF: [i16; SPELLED_RANGE] = {
    let mut table = [-1i16; SPELLED_RANGE];
    let mut moved = 0;
    let mut b = 0;
    while b < 256 {
        if stands_for_itself(b) {
            table[b] = b as i16;
        } else {
            table[256 + moved] = b as i16;
            moved += 1;
        }
        b += 1;
    }
    table
};

fn byte_of(c: char) -> Option<u8> {
    let index = usize::try_from(u32::from(c)).ok()?;
    let byte = *BYTE_OF.get(index)?;
    u8::try_from(byte).ok()
}

/// The bytes a byte-level token stands for. A token with any character outside the alphabet
/// (an added token such as "<｜end▁of▁sentence｜>") stands for its own UTF-8, as in the Hugging
/// Face `ByteLevel` decoder.
pub(crate) fn token_bytes(token: &str) -> Vec<u8> {
    token
        .chars()
        .map(byte_of)
        .collect::<Option<Vec<u8>>>()
        .unwrap_or_else(|| token.as_bytes().to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alphabet_is_a_bijection_matching_gpt2() {
        let mut bytes: Vec<u8> = BYTE_OF
            .iter()
            .filter_map(|&b| u8::try_from(b).ok())
            .collect();
        bytes.sort_unstable();
        assert_eq!(bytes, (0..=255u8).collect::<Vec<u8>>());
        // Spot values from GPT-2's bytes_to_unicode.
        assert_eq!(byte_of('Ġ'), Some(b' '));
        assert_eq!(byte_of('Ċ'), Some(b'\n'));
        assert_eq!(byte_of('Ā'), Some(0));
        assert_eq!(byte_of('Ń'), Some(0xAD));
        assert_eq!(byte_of('a'), Some(b'a'));
        assert_eq!(byte_of(' '), None);
        assert_eq!(byte_of('▁'), None);
    }

    #[test]
    fn tokens_outside_the_alphabet_are_their_own_utf8() {
        assert_eq!(token_bytes("ĠhiĊ"), b" hi\n");
        assert_eq!(
            token_bytes("<｜end▁of▁sentence｜>"),
            "<｜end▁of▁sentence｜>".as_bytes()
        );
    }
}
