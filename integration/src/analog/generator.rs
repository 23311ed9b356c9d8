//! The analog's request generator: open-loop, seeded Poisson arrivals at a given rate, each request on a
//! connection of its own to the proxy, every token's arrival recorded.
use std::{
    io::{BufRead, BufReader, Write},
    os::unix::net::UnixStream,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use rand::{Rng, SeedableRng, rngs::StdRng};

/// What to generate.
#[derive(Clone, Debug)]
pub struct Load {
    /// Mean arrivals per second.
    pub rate_per_s: f64,
    /// Arrivals stop after this long.
    pub duration: Duration,
    /// The seed of the arrival times (the same seed, the same arrivals).
    pub seed: u64,
}

/// One request as the client saw it; times are from its scheduled arrival.
#[derive(Clone, Debug, Default)]
pub struct RequestRecord {
    /// When it was due, from the start of the run.
    pub arrival: Duration,
    /// Each token's arrival, from the request's.
    pub tokens: Vec<Duration>,
    /// From its arrival to the end of its stream.
    pub total: Duration,
    /// Why it failed, if it did.
    pub error: Option<String>,
}

impl RequestRecord {
    /// Latency to the first token.
    pub fn first_token(&self) -> Option<Duration> {
        self.tokens.first().copied()
    }

    /// The gaps between successive tokens.
    pub fn gaps(&self) -> impl Iterator<Item = Duration> + '_ {
        self.tokens.windows(2).map(|w| w[1].saturating_sub(w[0]))
    }

    /// Time per output token: the mean gap (the seed's measure), if it had two tokens.
    pub fn tpot(&self) -> Option<Duration> {
        let n = u32::try_from(self.tokens.len().checked_sub(1)?).ok()?;
        (n > 0).then(|| (self.tokens[self.tokens.len() - 1] - self.tokens[0]) / n)
    }
}

/// The arrival times of `load`: exponential gaps of mean 1/rate, from a seeded generator.
pub fn arrivals(load: &Load) -> Vec<Duration> {
    let mut rng = StdRng::seed_from_u64(load.seed);
    let mut t = 0.0f64;
    let mut out = Vec::new();
    loop {
        // Inverse-CDF sampling of Exp(rate): 1 - U is in (0, 1], so the log is finite.
        t += -(1.0 - rng.random::<f64>()).ln() / load.rate_per_s;
        if t >= load.duration.as_secs_f64() {
            return out;
        }
        out.push(Duration::from_secs_f64(t));
    }
}

/// Sends `load`'s requests to the proxy at `proxy`, each at its arrival time from a thread of its own, and
/// returns their records (in arrival order) once every one has finished.
pub fn run(proxy: &Path, load: &Load) -> Vec<RequestRecord> {
    let start = Instant::now();
    let handles: Vec<_> = arrivals(load)
        .into_iter()
        .enumerate()
        .map(|(n, arrival)| {
            if let Some(wait) = arrival.checked_sub(start.elapsed()) {
                std::thread::sleep(wait);
            }
            let proxy = proxy.to_owned();
            std::thread::spawn(move || one_request(&proxy, n, start + arrival, arrival))
        })
        .collect();
    handles
        .into_iter()
        .map(|h| {
            h.join().unwrap_or_else(|_| RequestRecord {
                error: Some("the request thread panicked".into()),
                ..RequestRecord::default()
            })
        })
        .collect()
}

fn one_request(proxy: &PathBuf, n: usize, due: Instant, arrival: Duration) -> RequestRecord {
    let mut record = RequestRecord {
        arrival,
        ..RequestRecord::default()
    };
    let streamed = (|| -> std::io::Result<()> {
        let mut stream = UnixStream::connect(proxy)?;
        writeln!(stream, "r{n}")?;
        for line in BufReader::new(stream).lines() {
            line?;
            record.tokens.push(due.elapsed());
        }
        Ok(())
    })();
    record.total = due.elapsed();
    if let Err(e) = streamed {
        record.error = Some(e.to_string());
    } else if record.tokens.is_empty() {
        record.error = Some("no token came back".into());
    }
    record
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arrivals_are_seeded_and_near_the_rate() {
        let load = Load {
            rate_per_s: 50.0,
            duration: Duration::from_secs(100),
            seed: 7,
        };
        let a = arrivals(&load);
        assert_eq!(a, arrivals(&load));
        assert!((4500..5500).contains(&a.len()), "{} arrivals", a.len());
        assert!(a.windows(2).all(|w| w[0] <= w[1]));
        let other = arrivals(&Load { seed: 8, ..load });
        assert_ne!(a[..10], other[..10]);
    }

    #[test]
    fn a_record_yields_gaps_and_tpot() {
        let ms = Duration::from_millis;
        let r = RequestRecord {
            tokens: vec![ms(30), ms(35), ms(45)],
            ..RequestRecord::default()
        };
        assert_eq!(r.first_token(), Some(ms(30)));
        assert_eq!(r.gaps().collect::<Vec<_>>(), vec![ms(5), ms(10)]);
        assert_eq!(r.tpot(), Some(Duration::from_micros(7500)));
    }
}
