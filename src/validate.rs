//! Pure checks of the buffers a caller hands in: lengths, device, overlap. They run before any
//! launch, on plain numbers (lengths and address ranges), so they are tested on the CPU.

use crate::error::{Error, Result};

/// What the checks need to know about one buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BufInfo {
    /// The argument's name, as the API spells it.
    pub name: &'static str,
    /// Device address of the first element.
    pub ptr: u64,
    /// Elements.
    pub len: usize,
    /// Bytes per element.
    pub elem: usize,
    /// Device ordinal the buffer lives on.
    pub ordinal: usize,
}

impl BufInfo {
    /// `[ptr, ptr + len * elem)`.
    pub fn range(&self) -> (u64, u64) {
        (self.ptr, self.ptr + (self.len * self.elem) as u64)
    }
}

/// `buf.len == want`.
pub fn expect_len(buf: &BufInfo, want: usize, what: &str) -> Result<()> {
    if buf.len != want {
        return Err(Error::invalid(
            buf.name,
            format!("has {} elements, expected {want} ({what})", buf.len),
        ));
    }
    Ok(())
}

/// The buffer lives on the Context's device.
pub fn expect_device(buf: &BufInfo, ordinal: usize) -> Result<()> {
    if buf.ordinal != ordinal {
        return Err(Error::invalid(
            buf.name,
            format!(
                "lives on device {}, but the Context runs on device {ordinal}",
                buf.ordinal
            ),
        ));
    }
    Ok(())
}

/// Whether two buffers share any byte (empty buffers share none).
pub fn overlaps(a: &BufInfo, b: &BufInfo) -> bool {
    let (a0, a1) = a.range();
    let (b0, b1) = b.range();
    a0 < b1 && b0 < a1
}

/// `out` must not share memory with `other`; the error names `out`.
pub fn expect_disjoint(out: &BufInfo, other: &BufInfo) -> Result<()> {
    if overlaps(out, other) {
        return Err(Error::invalid(
            out.name,
            format!(
                "overlaps `{}` in device memory; they must be distinct",
                other.name
            ),
        ));
    }
    Ok(())
}

/// Every output is disjoint from every other buffer (inputs and other outputs).
pub fn expect_outputs_disjoint(outputs: &[BufInfo], inputs: &[BufInfo]) -> Result<()> {
    for (i, o) in outputs.iter().enumerate() {
        for other in outputs[..i].iter().chain(inputs) {
            expect_disjoint(o, other)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(name: &'static str, ptr: u64, len: usize) -> BufInfo {
        BufInfo {
            name,
            ptr,
            len,
            elem: 4,
            ordinal: 0,
        }
    }

    #[test]
    fn overlap_is_half_open() {
        assert!(!overlaps(&b("a", 0, 4), &b("b", 16, 4)));
        assert!(overlaps(&b("a", 0, 5), &b("b", 16, 4)));
        assert!(overlaps(&b("a", 16, 1), &b("b", 16, 1)));
        assert!(!overlaps(&b("a", 16, 0), &b("b", 16, 4)));
    }

    #[test]
    fn errors_name_the_output() {
        let e = expect_outputs_disjoint(&[b("y", 100, 10)], &[b("x", 96, 4)]).unwrap_err();
        assert_eq!(e.argument(), Some("y"));
        assert!(e.to_string().contains("`x`"));
        let e = expect_outputs_disjoint(&[b("dx", 0, 4), b("dz", 8, 4)], &[]).unwrap_err();
        assert_eq!(e.argument(), Some("dz"));
        assert!(expect_outputs_disjoint(&[b("y", 0, 4)], &[b("x", 16, 4)]).is_ok());
        let e = expect_len(&b("gamma", 0, 3), 4, "C").unwrap_err();
        assert_eq!(e.argument(), Some("gamma"));
        let mut g = b("gamma", 0, 4);
        g.ordinal = 1;
        assert_eq!(expect_device(&g, 0).unwrap_err().argument(), Some("gamma"));
    }
}
