//! Reading the protocol's newline-delimited lines from a socket with a bound on their length: the agent's
//! socket, a shim's control socket and the client all read through [`BoundedLines`], so a peer that sends a
//! line without end (megabytes, no newline) gets an error instead of growing the reader's memory.
use std::io;

use tokio::io::{AsyncBufRead, AsyncBufReadExt};

/// The longest request line a server (the agent, a shim's control socket) reads: requests are small.
pub const MAX_REQUEST_LINE: usize = 1 << 20;

/// The longest line the client reads: a `status` of a busy node, a preemption's reply with its steps.
pub const MAX_REPLY_LINE: usize = 64 << 20;

/// The lines of a reader, each at most `max` bytes (newline excluded).
#[derive(Debug)]
pub struct BoundedLines<R> {
    reader: R,
    buf: Vec<u8>,
    max: usize,
}

impl<R: AsyncBufRead + Unpin> BoundedLines<R> {
    /// The lines of `reader`, each at most `max` bytes.
    pub fn new(reader: R, max: usize) -> Self {
        Self {
            reader,
            buf: Vec::new(),
            max,
        }
    }

    /// The reader.
    pub fn get_ref(&self) -> &R {
        &self.reader
    }

    /// The reader, mutably (to write on a stream that reads and writes).
    pub fn get_mut(&mut self) -> &mut R {
        &mut self.reader
    }

    /// The next line without its `\n` (or `\r\n`); `None` at the end of the stream. A line longer than the
    /// bound is an [`io::ErrorKind::InvalidData`] error (see [`is_too_long`]) after reading at most the
    /// bound: the stream is then mid-line, and the caller answers and closes it. Cancel-safe (a line begun
    /// is kept for the next call), as `select!` needs.
    pub async fn next_line(&mut self) -> io::Result<Option<String>> {
        loop {
            let available = self.reader.fill_buf().await?;
            if available.is_empty() {
                return if self.buf.is_empty() {
                    Ok(None)
                } else {
                    self.take().map(Some)
                };
            }
            let newline = available.iter().position(|&b| b == b'\n');
            let n = newline.map_or(available.len(), |i| i + 1);
            let content = self.buf.len() + newline.map_or(n, |i| i);
            if content > self.max {
                self.buf = Vec::new();
                return Err(too_long(self.max));
            }
            self.buf.extend_from_slice(&available[..n]);
            self.reader.consume(n);
            if newline.is_some() {
                return self.take().map(Some);
            }
        }
    }

    fn take(&mut self) -> io::Result<String> {
        while matches!(self.buf.last(), Some(b'\n' | b'\r')) {
            self.buf.pop();
        }
        String::from_utf8(std::mem::take(&mut self.buf))
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
    }
}

/// The error of a line over `max` bytes.
fn too_long(max: usize) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, LineTooLong { max })
}

/// A line longer than the bound.
#[derive(Debug, thiserror::Error)]
#[error(
    "a line longer than {max} bytes (no newline within the bound): not a request of this protocol"
)]
pub struct LineTooLong {
    /// The bound.
    pub max: usize,
}

/// Whether `e` is the error of a line over the bound (or one that is not UTF-8), after which the stream is
/// not to be read on.
pub fn is_too_long(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::InvalidData
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::BufReader;

    async fn lines_of(input: &[u8], max: usize) -> Vec<io::Result<Option<String>>> {
        let mut lines = BoundedLines::new(BufReader::with_capacity(4, input), max);
        let mut out = Vec::new();
        loop {
            let next = lines.next_line().await;
            let end = !matches!(next, Ok(Some(_)));
            out.push(next);
            if end {
                return out;
            }
        }
    }

    #[tokio::test]
    async fn lines_within_the_bound_are_read_as_lines_are() {
        let out = lines_of(b"{\"a\":1}\r\nsecond\nlast", 8).await;
        let got: Vec<Option<String>> = out.into_iter().map(Result::unwrap).collect();
        assert_eq!(
            got,
            [
                Some("{\"a\":1}".to_owned()),
                Some("second".to_owned()),
                Some("last".to_owned()),
                None
            ]
        );
    }

    #[tokio::test]
    async fn a_line_over_the_bound_is_an_error_and_exactly_the_bound_is_not() {
        let out = lines_of(b"12345678\n123456789\n", 8).await;
        assert_eq!(out[0].as_ref().unwrap().as_deref(), Some("12345678"));
        let e = out[1].as_ref().unwrap_err();
        assert!(is_too_long(e) && e.to_string().contains("8 bytes"), "{e}");
        let endless = vec![b'x'; 1000];
        let e = lines_of(&endless, 100).await.remove(0).unwrap_err();
        assert!(is_too_long(&e));
    }
}
