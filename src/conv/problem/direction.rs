//! Which computation of a convolution layer: the forward, the data gradient or the filter
//! gradient.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// Which computation of a convolution layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Direction {
    /// `y = conv(x, w)`.
    Forward,
    /// `dx` from `dy` and `w`.
    BackwardData,
    /// `dw` from `x` and `dy`.
    BackwardFilter,
}

impl Direction {
    /// The three directions.
    pub const ALL: [Direction; 3] = [
        Direction::Forward,
        Direction::BackwardData,
        Direction::BackwardFilter,
    ];

    /// `forward`, `backward_data`, `backward_filter`.
    pub const fn name(self) -> &'static str {
        match self {
            Direction::Forward => "forward",
            Direction::BackwardData => "backward_data",
            Direction::BackwardFilter => "backward_filter",
        }
    }

    /// The operation in words.
    pub const fn describe(self) -> &'static str {
        match self {
            Direction::Forward => "forward convolution",
            Direction::BackwardData => "data gradient",
            Direction::BackwardFilter => "filter gradient",
        }
    }

    /// Position in [`Direction::ALL`] (an index into per-direction arrays).
    pub const fn index(self) -> usize {
        match self {
            Direction::Forward => 0,
            Direction::BackwardData => 1,
            Direction::BackwardFilter => 2,
        }
    }
}

impl fmt::Display for Direction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Direction {
    type Err = Error;
    /// `forward`, `backward-data` / `backward_data` / `bwd-data`, `backward-filter` /
    /// `backward_filter` / `bwd-filter` (any case).
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().replace('-', "_").as_str() {
            "forward" | "fwd" => Ok(Direction::Forward),
            "backward_data" | "bwd_data" | "data" => Ok(Direction::BackwardData),
            "backward_filter" | "bwd_filter" | "filter" => Ok(Direction::BackwardFilter),
            _ => Err(Error::invalid(
                "direction",
                format!("{s:?} is not one of forward, backward-data, backward-filter"),
            )),
        }
    }
}
