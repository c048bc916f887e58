//! The `[writeback]` table of a stack file: the dirty budget every cache shares (see
//! [`cairn_stacks::cache::writeback`]).

use cairn_core::size::{parse_duration, parse_size};
use cairn_core::Error;
use toml::{Table, Value};

use cairn_stacks::cache::writeback::{Amount, Writeback};

const KEYS: [&str; 4] = ["background", "limit", "expire", "interval"];

/// Parses a `[writeback]` table; missing keys keep the defaults.
pub(super) fn parse(table: &Table) -> Result<Writeback, Error> {
    let mut w = Writeback::default();
    for (k, v) in table {
        match k.as_str() {
            "background" => w.background = amount(k, v)?,
            "limit" => w.limit = amount(k, v)?,
            "expire" | "interval" => {
                let Value::String(s) = v else {
                    return Err(Error::Invalid(format!(
                        "writeback: key '{k}' must be a duration such as \"5s\""
                    )));
                };
                let d = parse_duration(s)
                    .map_err(|e| Error::Invalid(format!("writeback: key '{k}' is {e}")))?;
                let range = if k == "expire" {
                    super::limits::EXPIRE
                } else {
                    super::limits::INTERVAL
                };
                if !range.contains(&d) {
                    return Err(Error::Invalid(format!(
                        "writeback: key '{k}' = \"{}\" is out of range (from {} to {})",
                        super::shown(s),
                        super::format_duration(*range.start()),
                        super::format_duration(*range.end())
                    )));
                }
                if k == "expire" {
                    w.expire = d;
                } else {
                    w.interval = d;
                }
            }
            _ => {
                return Err(Error::Invalid(format!(
                    "writeback: unknown key '{}' (known: {})",
                    super::shown(k),
                    KEYS.join(", ")
                )))
            }
        }
    }
    Ok(w)
}

/// A level: a size (`"64M"`, or bytes) or a percentage (`"10%"`).
fn amount(key: &str, v: &Value) -> Result<Amount, Error> {
    let bad = || {
        Error::Invalid(format!(
            "writeback: key '{key}' must be a size such as \"64M\" or a percentage such as \"10%\""
        ))
    };
    match v {
        Value::String(s) if s.trim_end().ends_with('%') => {
            let p: f64 = s
                .trim_end()
                .trim_end_matches('%')
                .trim()
                .parse()
                .map_err(|_| bad())?;
            if !(0.0..=100.0).contains(&p) {
                return Err(Error::Invalid(format!(
                    "writeback: key '{key}' is {p}%, not from 0% to 100%"
                )));
            }
            Ok(Amount::Percent(p))
        }
        Value::String(s) => parse_size(s).map(Amount::Bytes).map_err(|_| bad()),
        Value::Integer(n) if *n >= 0 => Ok(Amount::Bytes(*n as u64)),
        _ => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn table(text: &str) -> Table {
        text.parse().unwrap()
    }

    #[test]
    fn parses_bytes_percentages_and_durations() {
        let w = parse(&table(
            "background = \"64M\"\nlimit = \"25%\"\nexpire = \"3s\"\ninterval = \"500ms\"",
        ))
        .unwrap();
        assert_eq!(w.background, Amount::Bytes(64 << 20));
        assert_eq!(w.limit, Amount::Percent(25.0));
        assert_eq!(w.expire, Duration::from_secs(3));
        assert_eq!(w.interval, Duration::from_millis(500));
        assert_eq!(parse(&table("")).unwrap(), Writeback::default());
        let t = w.throttle(1 << 30).unwrap();
        assert_eq!((t.background, t.limit), (64 << 20, 256 << 20));
    }

    #[test]
    fn every_mistake_names_its_key() {
        for (text, key) in [
            ("background = \"lots\"", "background"),
            ("limit = \"120%\"", "limit"),
            ("expire = 5", "expire"),
            ("interval = \"0s\"", "interval"),
            ("speed = 1", "speed"),
        ] {
            let e = parse(&table(text)).unwrap_err().to_string();
            assert!(e.contains(key), "{text}: {e}");
        }
        let w = parse(&table("background = \"30%\"\nlimit = \"20%\"")).unwrap();
        assert!(w
            .throttle(1 << 30)
            .unwrap_err()
            .to_string()
            .contains("below"));
    }
}
