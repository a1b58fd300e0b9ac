//! The bus in a build without the `cluster` feature: a `Bus` nothing can make (its one field
//! is private and nothing here builds one), so every `Option<Bus>` is `None` and the code that
//! would use one never runs. The real bus is `mod.rs` beside this file; `Config::check`
//! refuses `--bus` in such a build.

use std::convert::Infallible;
use std::sync::{Arc, Weak};
use std::time::Duration;

use crate::hub::{Following, Hub, Outbox, Remote};
use crate::turn::{Control, ControlReply};
use crate::wire::ConversationStatus;

#[derive(Clone)]
pub struct Bus(());

const NONE: &str = "a build without the cluster feature has no bus";

impl Bus {
    pub fn announce(&self, _: &str, _: ConversationStatus) {
        unreachable!("{NONE}")
    }

    pub async fn control(&self, _: &Control) -> Result<Option<ControlReply>, Infallible> {
        unreachable!("{NONE}")
    }

    pub fn connected(&self) -> bool {
        unreachable!("{NONE}")
    }
}

pub async fn serve_control(_: Bus, _: impl Fn(Control) -> Result<Option<ControlReply>, ()>) {
    unreachable!("{NONE}")
}

pub async fn relay_statuses(_: Bus, _: impl Fn(&str, ConversationStatus) -> bool) {
    unreachable!("{NONE}")
}

pub async fn end_interrupted(_: &Bus, _: &str, _: &str) -> Result<(), Infallible> {
    unreachable!("{NONE}")
}

impl Remote for Bus {
    fn outbox(&self, _: &str, _: &str, _: usize) -> Outbox {
        unreachable!("{NONE}")
    }

    fn follow(&self, _: Weak<Hub>, _: Arc<str>) -> Following {
        unreachable!("{NONE}")
    }

    fn share_readers(&self, _: Weak<Hub>) {
        unreachable!("{NONE}")
    }

    fn catch_up_timeout(&self) -> Duration {
        unreachable!("{NONE}")
    }
}
