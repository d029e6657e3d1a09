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

/// `CHAR_OF[b]` is the code point that spells byte `b`.
const CHAR_OF: [u16; 256] = {
    let mut table = [0u16; 256];
    let mut c = 0;
    while c < SPELLED_RANGE {
        if BYTE_OF[c] >= 0 {
            table[BYTE_OF[c] as usize] = c as u16;
        }
        c += 1;
    }
    table
};

/// The character that spells `byte`.
pub(crate) fn char_of(byte: u8) -> char {
    char::from_u32(u32::from(CHAR_OF[usize::from(byte)])).unwrap_or(char::REPLACEMENT_CHARACTER)
}

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
        let chars: std::collections::HashSet<char> = (0..=255u8).map(char_of).collect();
        assert_eq!(chars.len(), 256);
        for b in 0..=255u8 {
            assert_eq!(byte_of(char_of(b)), Some(b));
        }
        // Spot values from GPT-2's bytes_to_unicode.
        assert_eq!(char_of(b' '), 'Ġ');
        assert_eq!(char_of(b'\n'), 'Ċ');
        assert_eq!(char_of(0), 'Ā');
        assert_eq!(char_of(0xAD), 'Ń');
        assert_eq!(char_of(b'a'), 'a');
    }

    #[test]
    fn tokens_outside_the_alphabet_are_their_own_utf8() {
        assert_eq!(token_bytes("ĠhiĊ"), b" hi\n");
        assert_eq!(token_bytes("<｜end▁of▁sentence｜>"), "<｜end▁of▁sentence｜>".as_bytes());
    }
}
