//! transformers' `tojson` filter, which is Python's `json.dumps(x, ensure_ascii=False,
//! indent=None, separators=None, sort_keys=False)`. minijinja's built-in differs in ways a prompt
//! shows: it escapes `<`, `>`, `&` and `'`, and separates items with "," instead of ", ".

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Error, ErrorKind};
use std::fmt::Write;

struct Format {
    indent: Option<usize>,
    item_separator: String,
    key_separator: String,
    ensure_ascii: bool,
    sort_keys: bool,
}

pub(super) fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let (item_separator, key_separator) = match separators.as_deref() {
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => return Err(invalid("tojson separators must be (item, key)".into())),
    };
    let format = Format {
        indent,
        item_separator,
        key_separator,
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_value(&mut out, value, &format, 0)?;
    Ok(Value::from_safe_string(out))
}

fn write_value(
    out: &mut String,
    value: &Value,
    format: &Format,
    depth: usize,
) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&number(value)?),
        ValueKind::String => {
            write_string(out, value.as_str().unwrap_or_default(), format.ensure_ascii)
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            write_container(out, ('[', ']'), &items, format, depth, |out, item| {
                write_value(out, item, format, depth + 1)
            })?;
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                entries.push((key_string(&key)?, item));
            }
            if format.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            write_container(
                out,
                ('{', '}'),
                &entries,
                format,
                depth,
                |out, (key, item)| {
                    write_string(out, key, format.ensure_ascii);
                    out.push_str(&format.key_separator);
                    write_value(out, item, format, depth + 1)
                },
            )?;
        }
        other => {
            return Err(invalid(format!(
                "tojson cannot serialize a value of kind {other}"
            )))
        }
    }
    Ok(())
}

/// `[a, b]`, or one item per line when indenting (an empty container stays `[]`).
fn write_container<T>(
    out: &mut String,
    (open, close): (char, char),
    items: &[T],
    format: &Format,
    depth: usize,
    mut write_item: impl FnMut(&mut String, &T) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if items.is_empty() {
        out.push(close);
        return Ok(());
    }
    let newline = |out: &mut String, level: usize| {
        if let Some(indent) = format.indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', indent * level));
        }
    };
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push_str(&format.item_separator);
        }
        newline(out, depth + 1);
        write_item(out, item)?;
    }
    newline(out, depth);
    out.push(close);
    Ok(())
}

/// JSON turns non-string keys into strings the way Python's `json` does.
fn key_string(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_string()),
        ValueKind::Number => number(key),
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.to_string()),
        ValueKind::None => Ok("null".to_string()),
        other => Err(invalid(format!("tojson cannot use a {other} as a key"))),
    }
}

fn number(value: &Value) -> Result<String, Error> {
    if value.is_integer() {
        return Ok(value.to_string());
    }
    let x = f64::try_from(value.clone())?;
    Ok(python_float(x))
}

/// Python's `repr(float)`: shortest round-trip digits, positional for exponents in [-4, 16),
/// scientific with a signed two-digit exponent otherwise; JSON's NaN/Infinity spellings.
pub(super) fn python_float(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    if x == 0.0 {
        return if x.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    let sci = format!("{:e}", x.abs());
    let (mantissa, exponent) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let sign = if x < 0.0 { "-" } else { "" };
    if (-4..16).contains(&exponent) {
        let point = exponent + 1;
        if point <= 0 {
            let zeros = "0".repeat(point.unsigned_abs() as usize);
            format!("{sign}0.{zeros}{digits}")
        } else {
            let point = point as usize;
            if digits.len() > point {
                format!("{sign}{}.{}", &digits[..point], &digits[point..])
            } else {
                format!("{sign}{digits}{}.0", "0".repeat(point - digits.len()))
            }
        }
    } else {
        let (first, rest) = digits.split_at(1.min(digits.len()));
        let fraction = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let exp_sign = if exponent < 0 { '-' } else { '+' };
        format!(
            "{sign}{first}{fraction}e{exp_sign}{:02}",
            exponent.unsigned_abs()
        )
    }
}

/// A JSON string as Python writes it: short escapes for `"`, `\` and \b \f \n \r \t, `\u00XX`
/// for other control characters, and with `ensure_ascii` `\uXXXX` (surrogate pairs above the
/// BMP) for everything outside ASCII.
fn write_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && !c.is_ascii()) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn invalid(message: String) -> Error {
    Error::new(ErrorKind::InvalidOperation, message)
}

#[cfg(test)]
mod tests {
    use super::python_float;

    #[test]
    fn floats_print_as_python_repr() {
        // Expected strings are Python 3's repr of the same values.
        let cases = [
            (1.0, "1.0"),
            (2.5, "2.5"),
            (-0.0, "-0.0"),
            (0.1 + 0.2, "0.30000000000000004"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (123456789012345680.0, "1.2345678901234568e+17"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (-1.5e-7, "-1.5e-07"),
            (1.5e300, "1.5e+300"),
            (12345678.9, "12345678.9"),
            (f64::NAN, "NaN"),
            (f64::NEG_INFINITY, "-Infinity"),
        ];
        for (x, expected) in cases {
            assert_eq!(python_float(x), expected, "{x:?}");
        }
    }
}
