//! The one syntax of Baton's durations (`baton.io/wait-gpu-free`, `cuda_lock_timeout`, and
//! `baton-hook wait-gpu-free --timeout`): humantime's, "500ms", "20s", "2m"; zero is refused.
use std::time::Duration;

/// What [`parse_duration`] accepts, for error messages.
pub const DURATION_SYNTAX: &str = "a duration such as \"500ms\", \"20s\" or \"2m\"";

/// The longest `wait-gpu-free` a container may ask: a Start held a day is a mistake, and a bound keeps the
/// deadlines built from it (plus margins) far from overflowing.
pub const MAX_WAIT_GPU_FREE: Duration = Duration::from_secs(24 * 3600);

/// "500ms", "20s", "2m" (humantime's syntax, surrounding spaces ignored); `None` for anything else and for
/// a zero duration.
pub fn parse_duration(value: &str) -> Option<Duration> {
    humantime::parse_duration(value.trim())
        .ok()
        .filter(|d| !d.is_zero())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_in_the_annotation_syntax_parse_and_zero_or_junk_do_not() {
        assert_eq!(parse_duration("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(parse_duration(" 20s "), Some(Duration::from_secs(20)));
        assert_eq!(parse_duration("2m"), Some(Duration::from_secs(120)));
        assert_eq!(parse_duration("0s"), None);
        assert_eq!(parse_duration("soon"), None);
        assert_eq!(parse_duration(""), None);
    }
}
