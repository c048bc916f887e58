//! Sizes and durations as people type them: `4k`, `64KiB`, `1G`, `512`, `1ms`, `30s`.
//!
//! Size suffixes are binary, as fio's are by default (`k` = `KiB` = `KB` = 1024). A size
//! is a whole number of bytes; anything else (a fraction, a negative number, an unknown
//! suffix, an overflow) is refused with a message that quotes the input.

use std::time::Duration;

/// Parses a size such as `4k`, `1GiB` or `4096`.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, suffix) = t.split_at(split);
    if num.is_empty() {
        return Err(format!(
            "invalid size '{text}': expected a number such as 4k, 1M or 1G"
        ));
    }
    let n: u64 = num
        .parse()
        .map_err(|_| format!("invalid size '{text}': number too large"))?;
    let shift = match suffix.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        "p" | "pb" | "pib" => 50,
        _ => {
            return Err(format!(
                "invalid size '{text}': unknown suffix '{suffix}' (use k, M, G, T or P)"
            ))
        }
    };
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("invalid size '{text}': too large"))
}

/// Parses a duration such as `1ms`, `250us`, `30s`, `2m`, `1h`, `1d` or a bare number of
/// seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    if t.starts_with('-') {
        return Err(format!(
            "invalid duration '{text}': must not be negative (e.g. 10s, 500ms or 100us)"
        ));
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, suffix) = t.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("invalid duration '{text}': expected e.g. 10s, 500ms or 100us"))?;
    let scale_ns = match suffix.to_ascii_lowercase().as_str() {
        "" | "s" | "sec" => 1e9,
        "ns" => 1.0,
        "us" | "usec" => 1e3,
        "ms" | "msec" => 1e6,
        "m" | "min" => 60e9,
        "h" => 3600e9,
        "d" | "day" | "days" => 86400e9,
        _ => {
            return Err(format!(
                "invalid duration '{text}': unknown unit '{suffix}'"
            ))
        }
    };
    let ns = value * scale_ns;
    if !ns.is_finite() || !(0.0..=1e18).contains(&ns) {
        return Err(format!("invalid duration '{text}': out of range"));
    }
    Ok(Duration::from_nanos(ns as u64))
}

/// Formats bytes with a binary suffix, e.g. `1.5GiB`, `4KiB`, `512B`.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    // One decimal place: a value that rounds up to 1024 is the next unit's 1.0.
    if unit > 0 && unit < UNITS.len() - 1 && (value * 10.0).round() >= 10240.0 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 || value.fract() == 0.0 {
        format!("{}{}", value as u64, UNITS[unit])
    } else {
        format!("{value:.1}{}", UNITS[unit])
    }
}

/// `size` as a stack file can give it back exactly, in the largest unit that divides it:
/// "20G", "1536M", "4097".
pub fn exact_size(size: u64) -> String {
    for (unit, shift) in [("T", 40), ("G", 30), ("M", 20), ("K", 10)] {
        if size > 0 && size.is_multiple_of(1 << shift) {
            return format!("{}{unit}", size >> shift);
        }
    }
    size.to_string()
}

/// Formats a rate in bytes a second the way sizes are written, e.g. `138.6MiB/s`: logs and
/// status use this one style (bench's reports keep fio's decimal MB/s).
pub fn format_rate(bytes_per_s: f64) -> String {
    let whole = if bytes_per_s.is_finite() && bytes_per_s > 0.0 {
        bytes_per_s.round() as u64
    } else {
        0
    };
    format!("{}/s", format_bytes(whole))
}

/// Formats a duration as it is written on the command line: `30s`, `1.5s`, `250ms`,
/// `10m`, `2h`.
pub fn format_duration(d: Duration) -> String {
    let ns = d.as_nanos();
    let s = d.as_secs();
    if ns == 0 {
        "0s".into()
    } else if ns.is_multiple_of(3_600_000_000_000) {
        format!("{}h", s / 3600)
    } else if ns.is_multiple_of(60_000_000_000) {
        format!("{}m", s / 60)
    } else if ns >= 1_000_000_000 {
        let v = d.as_secs_f64();
        if v.fract() == 0.0 {
            format!("{s}s")
        } else {
            format!("{v:.1}s")
        }
    } else if ns >= 1_000_000 {
        format!("{}ms", d.as_millis())
    } else if ns >= 1_000 {
        format!("{}us", d.as_micros())
    } else {
        format!("{ns}ns")
    }
}

/// `1 request`, `2 requests`: a count with its noun, singular for one.
pub fn plural(n: u64, singular: &str, plural: &str) -> String {
    if n == 1 {
        format!("1 {singular}")
    } else {
        format!("{n} {plural}")
    }
}

/// Formats a count with a decimal suffix, as fio prints IOPS: `2.85M`, `84.1k`, `950`.
pub fn format_count(n: f64) -> String {
    if n >= 1e9 {
        format!("{:.2}G", n / 1e9)
    } else if n >= 1e6 {
        format!("{:.2}M", n / 1e6)
    } else if n >= 1e3 {
        format!("{:.1}k", n / 1e3)
    } else {
        format!("{n:.0}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("512"), Ok(512));
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("64KiB"), Ok(65536));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("10g"), Ok(10 << 30));
        assert_eq!(parse_size("2T"), Ok(2 << 40));
        for bad in [
            "",
            "k",
            "1.5G",
            "-4k",
            "4x",
            "99999999999999999999",
            "16777216P",
        ] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn formats() {
        assert_eq!(format_rate(138.6 * 1024.0 * 1024.0), "138.6MiB/s");
        assert_eq!(format_rate(0.0), "0B/s");
        assert_eq!(format_bytes((1 << 20) - 1), "1.0MiB");
        assert_eq!(format_bytes(1023), "1023B");
        assert_eq!(format_bytes(1536), "1.5KiB");
        assert_eq!(format_rate(f64::NAN), "0B/s");
        assert_eq!(format_duration(Duration::from_secs(30)), "30s");
        assert_eq!(format_duration(Duration::from_millis(1500)), "1.5s");
        assert_eq!(format_duration(Duration::from_millis(250)), "250ms");
        assert_eq!(format_duration(Duration::from_secs(600)), "10m");
        assert_eq!(format_duration(Duration::from_secs(7200)), "2h");
        assert_eq!(format_duration(Duration::ZERO), "0s");
        assert_eq!(plural(1, "request", "requests"), "1 request");
        assert_eq!(plural(0, "request", "requests"), "0 requests");
        assert_eq!(plural(2, "entry", "entries"), "2 entries");
        // Round trips through the parser.
        for text in ["30s", "1.5s", "250ms", "10m", "2h", "100us"] {
            let d = parse_duration(text).expect("parses");
            assert_eq!(format_duration(d), text);
        }
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("1ms"), Ok(Duration::from_millis(1)));
        assert_eq!(parse_duration("10"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("2.5s"), Ok(Duration::from_millis(2500)));
        assert_eq!(parse_duration("100us"), Ok(Duration::from_micros(100)));
        for bad in ["", "ms", "1x", "-1s", "1e400"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn formatting() {
        assert_eq!(format_bytes(512), "512B");
        assert_eq!(format_bytes(4096), "4KiB");
        assert_eq!(format_bytes(1536 << 20), "1.5GiB");
        assert_eq!(format_count(2_850_000.0), "2.85M");
        assert_eq!(format_count(84_100.0), "84.1k");
    }
}
