//! The CUDA side, loaded at run time through cudarc (dynamic loading), so this compiles on a
//! machine without a CUDA toolkit and fails with a clear message where no driver exists.
//!
//! Built so far: the driver probe and the device kernels (`attention::cuda`), which are
//! compiled with NVRTC and checked here. Not built yet: the `Backend` implementation on top of
//! them (cuBLAS projections, pinned pool, recall stream), `selftest` and `bench decode` on a GPU.

use std::fmt;

/// Why CUDA cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// libcuda could not be loaded.
    #[error("no CUDA driver found (libcuda.so could not be loaded); use --device cpu")]
    NoDriver,
    /// The driver failed to initialise or count devices.
    #[error("CUDA driver error: {0}")]
    Driver(String),
    /// The requested ordinal does not exist.
    #[error("CUDA device {ordinal} does not exist ({count} visible)")]
    NoSuchDevice {
        /// Requested.
        ordinal: usize,
        /// Visible devices.
        count: usize,
    },
    /// libnvrtc could not be loaded.
    #[error("NVRTC (libnvrtc.so) could not be loaded; install the CUDA runtime libraries")]
    NoNvrtc,
    /// A kernel failed to compile.
    #[error("NVRTC compile error: {0}")]
    Compile(String),
}

/// What the probe found.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    /// Ordinal.
    pub ordinal: usize,
    /// Devices visible.
    pub count: usize,
}

impl fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "cuda:{} ({} visible)", self.ordinal, self.count)
    }
}

/// Checks that libcuda loads and `ordinal` exists, before any other CUDA call: with dynamic
/// loading, the first call into a missing library would panic.
pub fn probe(ordinal: usize) -> Result<DeviceInfo, CudaError> {
    // SAFETY: only tries to dlopen libcuda; no CUDA function is called.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CudaError::NoDriver);
    }
    cudarc::driver::result::init().map_err(|e| CudaError::Driver(format!("{e:?}")))?;
    let count = cudarc::driver::result::device::get_count()
        .map_err(|e| CudaError::Driver(format!("{e:?}")))?;
    let count = usize::try_from(count).unwrap_or(0);
    if ordinal >= count {
        return Err(CudaError::NoSuchDevice { ordinal, count });
    }
    Ok(DeviceInfo { ordinal, count })
}

/// Compiles the device kernels to PTX with NVRTC.
pub fn compile_kernels() -> Result<String, CudaError> {
    // SAFETY: only tries to dlopen libnvrtc.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaError::NoNvrtc);
    }
    let ptx = cudarc::nvrtc::compile_ptx(attention::cuda::KERNELS_CU)
        .map_err(|e| CudaError::Compile(format!("{e:?}")))?;
    Ok(ptx.to_src())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels_compile_to_ptx_where_nvrtc_exists() {
        match compile_kernels() {
            Err(CudaError::NoNvrtc) => {
                eprintln!(
                    "skipped: libnvrtc is not loadable here (pip install nvidia-cuda-nvrtc, LD_LIBRARY_PATH)"
                );
            }
            Err(e) => panic!("{e}"),
            Ok(ptx) => {
                for entry in attention::cuda::ENTRY_POINTS {
                    assert!(
                        ptx.contains(&format!(".entry {entry}")),
                        "PTX lacks {entry}"
                    );
                }
            }
        }
    }

    #[test]
    fn probe_fails_cleanly_without_a_driver() {
        // On CI there is no libcuda: a clear error, never a panic. With a GPU, device 0 exists.
        match probe(0) {
            Ok(info) => assert!(info.count > 0),
            Err(e) => assert!(
                matches!(e, CudaError::NoDriver | CudaError::Driver(_)),
                "{e}"
            ),
        }
        assert!(matches!(
            probe(usize::MAX),
            Err(CudaError::NoDriver | CudaError::Driver(_) | CudaError::NoSuchDevice { .. })
        ));
    }
}
