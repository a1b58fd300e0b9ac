//! Client-chosen text in log lines. A token's `sub`, a WebSocket message's conversation id and
//! the like reach the log as a client wrote them: a newline there would start a made-up log
//! line (a forged audit entry), an escape sequence would drive the operator's terminal. Logged
//! through [`Escaped`], every control character is written as an escape (`\n`, `\u{1b}`); the
//! JSON log format escapes them anyway.

use std::fmt::{self, Write};

/// `text` with its control characters escaped, for a log field (`subject = %Escaped(s)`).
pub struct Escaped<'a>(pub &'a str);

impl fmt::Display for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for c in self.0.chars() {
            if c.is_control() {
                write!(f, "{}", c.escape_default())?;
            } else {
                f.write_char(c)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::Escaped;

    #[test]
    fn control_characters_are_escaped_and_the_rest_kept() {
        assert_eq!(Escaped("eve\ninfo dispatch::audit: forged").to_string(), "eve\\ninfo dispatch::audit: forged");
        assert_eq!(Escaped("\u{1b}[31mred\r\u{7f}").to_string(), "\\u{1b}[31mred\\r\\u{7f}");
        assert_eq!(Escaped("élan \"quoted\" tab").to_string(), "élan \"quoted\" tab");
    }
}
