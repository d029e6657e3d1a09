//! How much memory the KV cache may take: a size (`2GiB`, `512MB`, `1e9`
//! bytes written out) or a fraction of the memory available now (`0.2`).
//!
//! Units: B, KB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB and the bare
//! K/M/G/T (powers of 1024, as docker and the JVM read them); any case. A
//! number without a unit is a fraction of available memory when at most 1,
//! else a byte count.

use std::str::FromStr;

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MemoryBudget {
    Bytes(u64),
    /// Of `MemAvailable` at start-up, in (0, 1].
    Fraction(f64),
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum MemoryError {
    #[error("`{0}` is not a memory size: use e.g. 2GiB, 512MB, 1073741824, or a fraction of available memory such as 0.2")]
    Syntax(String),
    #[error("a memory size must be positive, got `{0}`")]
    NotPositive(String),
    #[error("cannot read the available memory from /proc/meminfo ({0}); give a size such as 2GiB instead of a fraction")]
    Available(String),
}

impl FromStr for MemoryBudget {
    type Err = MemoryError;

    fn from_str(s: &str) -> Result<Self, MemoryError> {
        let syntax = || MemoryError::Syntax(s.to_string());
        let t = s.trim();
        let split = t
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(t.len());
        let (number, unit) = t.split_at(split);
        let value: f64 = number.parse().map_err(|_| syntax())?;
        if !value.is_finite() {
            return Err(syntax());
        }
        if value <= 0.0 {
            return Err(MemoryError::NotPositive(s.to_string()));
        }
        let unit = unit.trim().to_ascii_lowercase();
        if unit.is_empty() && value <= 1.0 {
            return Ok(MemoryBudget::Fraction(value));
        }
        let scale: f64 = match unit.as_str() {
            "" | "b" => 1.0,
            "kb" => 1e3,
            "mb" => 1e6,
            "gb" => 1e9,
            "tb" => 1e12,
            "k" | "kib" => 1024.0,
            "m" | "mib" => 1024.0 * 1024.0,
            "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
            "t" | "tib" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
            _ => return Err(syntax()),
        };
        let bytes = value * scale;
        // A fractional byte count is a typo; so is one beyond u64.
        if (scale == 1.0 && value.fract() != 0.0) || bytes >= u64::MAX as f64 {
            return Err(syntax());
        }
        Ok(MemoryBudget::Bytes(bytes as u64))
    }
}

impl MemoryBudget {
    /// The budget in bytes (a fraction reads `/proc/meminfo` now).
    pub fn bytes(self) -> Result<u64, MemoryError> {
        match self {
            MemoryBudget::Bytes(b) => Ok(b),
            MemoryBudget::Fraction(f) => {
                let text = std::fs::read_to_string("/proc/meminfo")
                    .map_err(|e| MemoryError::Available(e.to_string()))?;
                let avail = mem_available(&text)
                    .ok_or_else(|| MemoryError::Available("no MemAvailable line".into()))?;
                Ok((avail as f64 * f) as u64)
            }
        }
    }
}

/// `MemAvailable:  123456 kB` → bytes.
fn mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let mut words = line.split_whitespace().skip(1);
    let kib: u64 = words.next()?.parse().ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sizes_and_fractions() {
        let p = |s: &str| s.parse::<MemoryBudget>();
        assert_eq!(p("2GiB"), Ok(MemoryBudget::Bytes(2 << 30)));
        assert_eq!(p("512MB"), Ok(MemoryBudget::Bytes(512_000_000)));
        assert_eq!(p("1.5 g"), Ok(MemoryBudget::Bytes(3 << 29)));
        assert_eq!(p("1073741824"), Ok(MemoryBudget::Bytes(1 << 30)));
        assert_eq!(p("0.2"), Ok(MemoryBudget::Fraction(0.2)));
        assert_eq!(p("1"), Ok(MemoryBudget::Fraction(1.0)));
        for bad in [
            "",
            "GiB",
            "2XB",
            "1.5",
            "-1GiB",
            "1..2G",
            "99999999999999999999999",
        ] {
            assert!(p(bad).is_err(), "{bad}");
        }
        assert_eq!(p("0"), Err(MemoryError::NotPositive("0".into())));
    }

    #[test]
    fn reads_mem_available() {
        let text = "MemTotal: 100 kB\nMemAvailable:   2048 kB\n";
        assert_eq!(mem_available(text), Some(2 << 20));
        assert_eq!(mem_available("MemTotal: 1 kB\n"), None);
    }
}
