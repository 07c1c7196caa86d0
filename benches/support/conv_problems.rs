//! `benches/conv_problems.txt` parsed (one problem a line: name, n, c_in, h, w, c_out, kh, kw,
//! stride, pad_h, pad_w, dilation, type).

use nnfuse::conv::ConvShape;
use nnfuse::TensorFormat;

/// One line of `conv_problems.txt`.
#[derive(Debug, Clone)]
pub struct ConvProblem {
    pub name: String,
    pub shape: ConvShape,
    /// `f16`, `bf16` (NHWC) or `f32` (NCHW).
    pub dtype: String,
}

/// The problems of `text`; an error names the line.
pub fn parse(text: &str) -> Result<Vec<ConvProblem>, String> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() != 13 {
            return Err(format!("conv_problems.txt:{}: 13 fields", i + 1));
        }
        let u = |k: usize| -> Result<usize, String> {
            f[k].parse()
                .map_err(|e| format!("conv_problems.txt:{}: field {}: {e}", i + 1, k + 1))
        };
        let format = if f[12] == "f32" {
            TensorFormat::Nchw
        } else {
            TensorFormat::Nhwc
        };
        out.push(ConvProblem {
            name: f[0].to_string(),
            shape: ConvShape {
                n: u(1)?,
                c_in: u(2)?,
                h: u(3)?,
                w: u(4)?,
                c_out: u(5)?,
                kh: u(6)?,
                kw: u(7)?,
                stride: (u(8)?, u(8)?),
                pad: (u(9)?, u(10)?),
                dilation: (u(11)?, u(11)?),
                format,
            },
            dtype: f[12].to_string(),
        });
    }
    Ok(out)
}
