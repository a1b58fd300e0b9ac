//! Lines from an agent program's output, each at most a configured length: a program that
//! prints without a newline must not grow the gateway's buffer without end.

use std::io;

use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};

/// A line longer than the limit; the reader skips the rest of it before the next line.
#[derive(Debug, thiserror::Error)]
#[error("a line longer than {0} bytes")]
pub struct LineTooLong(pub usize);

pub struct BoundedLines<R> {
    reader: BufReader<R>,
    max: usize,
    line: Vec<u8>,
    /// The rest of a line past the limit is read and dropped up to its newline.
    skipping: bool,
}

impl<R: AsyncRead + Unpin> BoundedLines<R> {
    pub fn new(reader: R, max: usize) -> BoundedLines<R> {
        BoundedLines { reader: BufReader::new(reader), max, line: Vec::new(), skipping: false }
    }

    /// The next line without its `\n` (or `\r\n`), `None` at the end of the output. A line
    /// over the limit is an `InvalidData` error carrying [`LineTooLong`]. Cancel-safe, as
    /// tokio's `Lines`: what was read stays in `self` across an await point.
    pub async fn next_line(&mut self) -> io::Result<Option<String>> {
        loop {
            let available = self.reader.fill_buf().await?;
            if available.is_empty() {
                self.skipping = false;
                if self.line.is_empty() {
                    return Ok(None);
                }
                return self.take().map(Some);
            }
            let (part, end) = match newline(available) {
                Some(i) => (&available[..i], Some(i + 1)),
                None => (available, None),
            };
            let used = end.unwrap_or(available.len());
            let over = !self.skipping && self.line.len() + part.len() > self.max;
            if !self.skipping && !over {
                self.line.extend_from_slice(part);
            }
            self.reader.consume(used);
            if over {
                self.line = Vec::new();
                self.skipping = end.is_none();
                return Err(io::Error::new(io::ErrorKind::InvalidData, LineTooLong(self.max)));
            }
            if end.is_some() {
                if std::mem::take(&mut self.skipping) {
                    continue;
                }
                return self.take().map(Some);
            }
        }
    }

    fn take(&mut self) -> io::Result<String> {
        let mut line = std::mem::take(&mut self.line);
        if line.last() == Some(&b'\r') {
            line.pop();
        }
        String::from_utf8(line).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
    }
}

/// Whether an error is [`BoundedLines`]'s line over the limit.
pub fn too_long(error: &io::Error) -> bool {
    error.get_ref().is_some_and(|e| e.is::<LineTooLong>())
}

fn newline(bytes: &[u8]) -> Option<usize> {
    bytes.iter().position(|&b| b == b'\n')
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn lines(input: &'static [u8], max: usize) -> Vec<Result<String, bool>> {
        // Fed a few bytes at a time, so lines cross the reader's buffer boundaries.
        let (mut tx, rx) = tokio::io::duplex(3);
        tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            let _ = tx.write_all(input).await;
        });
        let mut reader = BoundedLines::new(rx, max);
        let mut out = Vec::new();
        loop {
            match reader.next_line().await {
                Ok(Some(line)) => out.push(Ok(line)),
                Ok(None) => return out,
                Err(e) => out.push(Err(too_long(&e))),
            }
        }
    }

    #[tokio::test]
    async fn lines_at_the_limit_pass_longer_ones_are_refused_and_skipped_to_their_end() {
        let got = lines(b"12345\nabc\r\n123456789\nok\nlast", 5).await;
        assert_eq!(got, vec![Ok("12345".into()), Ok("abc".into()), Err(true), Ok("ok".into()), Ok("last".into())]);
    }

    #[tokio::test]
    async fn an_endless_line_is_refused_once_and_the_output_still_ends() {
        let got = lines(b"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx", 8).await;
        assert_eq!(got, vec![Err(true)]);
    }

    #[tokio::test]
    async fn a_line_that_is_not_utf8_is_an_error_of_its_own() {
        let got = lines(b"\xff\xfe\nfine\n", 64).await;
        assert_eq!(got, vec![Err(false), Ok("fine".into())]);
    }
}
