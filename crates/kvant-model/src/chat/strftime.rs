//! `strftime_now(format)` for chat templates (Llama 3.1 prints "Today Date: 26 Jul 2024"): the C
//! `strftime` directives templates use, in the C locale, for a UTC time. An unknown directive is
//! an error rather than a silently different prompt.

use minijinja::{Error, ErrorKind};
use std::fmt::Write;

const WEEKDAYS: [&str; 7] = [
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
];
const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// A UTC calendar time.
struct Civil {
    year: i64,
    /// 1..=12
    month: usize,
    /// 1..=31
    day: i64,
    /// 0 = Sunday
    weekday: usize,
    /// 1..=366
    day_of_year: i64,
    hour: i64,
    minute: i64,
    second: i64,
}

impl Civil {
    fn from_unix(seconds: i64) -> Self {
        let days = seconds.div_euclid(86_400);
        let secs = seconds.rem_euclid(86_400);
        let (year, month, day) = civil_from_days(days);
        let jan1 = days_from_civil(year, 1, 1);
        Civil {
            year,
            month,
            day,
            // 1970-01-01 was a Thursday.
            weekday: (days + 4).rem_euclid(7) as usize,
            day_of_year: days - jan1 + 1,
            hour: secs / 3600,
            minute: secs / 60 % 60,
            second: secs % 60,
        }
    }
}

/// Days since 1970-01-01 → (year, month, day), proleptic Gregorian (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, usize, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month as usize, day)
}

fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Formats `unix_seconds` (UTC) with C `strftime` directives; `%-d` and friends drop the
/// zero padding as glibc does.
pub(super) fn format_utc(format: &str, unix_seconds: i64) -> Result<String, Error> {
    let t = Civil::from_unix(unix_seconds);
    let weekday = WEEKDAYS.get(t.weekday).copied().unwrap_or("");
    let month = MONTHS.get(t.month.wrapping_sub(1)).copied().unwrap_or("");
    let hour12 = if t.hour % 12 == 0 { 12 } else { t.hour % 12 };
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut directive = chars.next();
        let pad = directive != Some('-');
        if !pad {
            directive = chars.next();
        }
        let num = |out: &mut String, value: i64, width: usize| {
            let _ = if pad {
                write!(out, "{value:0width$}")
            } else {
                write!(out, "{value}")
            };
        };
        match directive {
            Some('a') => out.push_str(weekday.get(..3).unwrap_or(weekday)),
            Some('A') => out.push_str(weekday),
            Some('b') => out.push_str(month.get(..3).unwrap_or(month)),
            Some('B') => out.push_str(month),
            Some('d') => num(&mut out, t.day, 2),
            Some('m') => num(&mut out, t.month as i64, 2),
            Some('y') => num(&mut out, t.year.rem_euclid(100), 2),
            Some('Y') => {
                let _ = write!(out, "{}", t.year);
            }
            Some('j') => num(&mut out, t.day_of_year, 3),
            Some('H') => num(&mut out, t.hour, 2),
            Some('I') => num(&mut out, hour12, 2),
            Some('M') => num(&mut out, t.minute, 2),
            Some('S') => num(&mut out, t.second, 2),
            Some('p') => out.push_str(if t.hour < 12 { "AM" } else { "PM" }),
            Some('F') => {
                let _ = write!(out, "{}-{:02}-{:02}", t.year, t.month, t.day);
            }
            Some('T') => {
                let _ = write!(out, "{:02}:{:02}:{:02}", t.hour, t.minute, t.second);
            }
            Some('%') if pad => out.push('%'),
            other => {
                let shown = other.map_or(String::new(), String::from);
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now does not support %{}{shown}",
                        if pad { "" } else { "-" }
                    ),
                ));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::format_utc;

    #[derive(serde::Deserialize)]
    struct Case {
        unix: i64,
        format: String,
        expected: String,
    }

    /// Expected strings come from Python's `time.strftime(format, time.gmtime(unix))`.
    #[test]
    fn matches_python_strftime() {
        let cases: Vec<Case> = serde_json::from_str(include_str!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/chat/strftime.json"
        )))
        .expect("fixture parses");
        assert!(cases.len() > 10);
        for case in cases {
            let got = format_utc(&case.format, case.unix).expect("supported format");
            assert_eq!(got, case.expected, "{} at {}", case.format, case.unix);
        }
    }

    #[test]
    fn unknown_directives_are_errors() {
        assert!(format_utc("%Q", 0).is_err());
        assert!(format_utc("%", 0).is_err());
        assert!(format_utc("%-%", 0).is_err());
    }
}
