//! Where a model runs: `--device cpu | cuda | cuda:N`.

use std::fmt;
use std::str::FromStr;

/// The device a model runs on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Device {
    /// The host CPU (SIMD kernels, all cores).
    #[default]
    Cpu,
    /// NVIDIA GPU with this ordinal.
    Cuda(usize),
}

impl FromStr for Device {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("unknown device '{s}': expected cpu, cuda or cuda:N");
        match s.trim().to_ascii_lowercase().as_str() {
            "cpu" => Ok(Device::Cpu),
            "cuda" | "gpu" => Ok(Device::Cuda(0)),
            other => match other.strip_prefix("cuda:") {
                Some(n) => n.parse().map(Device::Cuda).map_err(|_| bad()),
                None => Err(bad()),
            },
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints() {
        for (s, d) in [("cpu", Device::Cpu), ("cuda", Device::Cuda(0)), ("CUDA:3", Device::Cuda(3)), ("gpu", Device::Cuda(0))] {
            assert_eq!(s.parse::<Device>(), Ok(d));
        }
        assert_eq!(Device::Cuda(2).to_string().parse::<Device>(), Ok(Device::Cuda(2)));
        for bad in ["tpu", "cuda:", "cuda:x", "cuda:-1", ""] {
            assert!(bad.parse::<Device>().unwrap_err().contains("expected cpu, cuda or cuda:N"), "{bad}");
        }
    }
}
