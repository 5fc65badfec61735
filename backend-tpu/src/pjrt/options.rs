//! Compile options: kiln's `xla.CompileOptionsProto`, written in protobuf's wire
//! format directly (see Note [Compile options]).

// Note [Compile options]
// ~~~~~~~~~~~~~~~~~~~~~~
// `PJRT_Client_Compile` takes a serialized `xla.CompileOptionsProto`
// (xla/pjrt/proto/compile_options.proto). kiln writes the few fields it sets
// by hand rather than depending on a protobuf library and XLA's .proto files:
//     CompileOptionsProto    executable_build_options = 3, compile_portable_executable = 4
//     ExecutableBuildOptions device_ordinal = 1 (-1: any), num_replicas = 4,
//                            num_partitions = 5, use_spmd_partitioning = 6,
//                            device_assignment = 9, use_shardy_partitioner = 19
//     DeviceAssignmentProto  replica_count = 1, computation_count = 2,
//                            computation_devices = 3 { repeated int64 replica_device_ids = 1 (packed) }
// A one-device program is compiled portable (the device is picked at each
// execution). A program over several devices (SPMD partitions of a mesh) is
// compiled for a fixed device assignment, with the SPMD partitioner on and
// Shardy as its partitioner; portable compilation must be off for it. The
// encoding is checked byte for byte against options the XLA:CPU plugin
// accepted (tests below).

/// What a program is compiled for.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CompileOptions {
    pub replicas: u64,
    pub partitions: u64,
    /// `use_spmd_partitioning`: the program is one SPMD module over `partitions` devices.
    pub spmd: bool,
    /// `use_shardy_partitioner`: the module's shardings are Shardy's (`sdy.mesh`, `#sdy.sharding`).
    pub shardy: bool,
    /// `compile_portable_executable`: one device, chosen at execution.
    pub portable: bool,
    /// The device ids running each (replica, partition): `assignment[replica][partition]`;
    /// `None` leaves the plugin's default.
    pub assignment: Option<Vec<Vec<i64>>>,
}

impl CompileOptions {
    /// One replica, one partition, portable: kiln's one-device programs.
    pub fn single() -> CompileOptions {
        CompileOptions { replicas: 1, partitions: 1, spmd: false, shardy: false, portable: true, assignment: None }
    }

    /// One SPMD program partitioned over `devices` (device ids, in partition
    /// order) with Shardy: a program over a device mesh.
    pub fn spmd(devices: &[i64]) -> CompileOptions {
        CompileOptions {
            replicas: 1,
            partitions: devices.len() as u64,
            spmd: true,
            shardy: true,
            portable: false,
            assignment: Some(vec![devices.to_vec()]),
        }
    }

    /// The number of devices one execution runs on.
    pub fn num_devices(&self) -> usize {
        (self.replicas * self.partitions) as usize
    }

    /// The serialized `CompileOptionsProto`.
    pub fn encode(&self) -> Vec<u8> {
        let mut build = vec![];
        tag(&mut build, 1, VARINT); // device_ordinal
        varint(&mut build, -1i64 as u64);
        tag(&mut build, 4, VARINT);
        varint(&mut build, self.replicas);
        tag(&mut build, 5, VARINT);
        varint(&mut build, self.partitions);
        if self.spmd {
            tag(&mut build, 6, VARINT);
            varint(&mut build, 1);
        }
        if let Some(a) = &self.assignment {
            let mut da = vec![];
            tag(&mut da, 1, VARINT);
            varint(&mut da, self.replicas);
            tag(&mut da, 2, VARINT);
            varint(&mut da, self.partitions);
            // One `computation_devices` per partition, listing its device in each replica.
            for p in 0..self.partitions as usize {
                let mut ids = vec![];
                for r in a {
                    varint(&mut ids, r.get(p).copied().unwrap_or(0) as u64);
                }
                let mut cd = vec![];
                bytes(&mut cd, 1, &ids);
                bytes(&mut da, 3, &cd);
            }
            bytes(&mut build, 9, &da);
        }
        if self.shardy {
            tag(&mut build, 19, VARINT);
            varint(&mut build, 1);
        }
        let mut out = vec![];
        bytes(&mut out, 3, &build);
        if self.portable {
            tag(&mut out, 4, VARINT);
            varint(&mut out, 1);
        }
        out
    }
}

const VARINT: u8 = 0;
const LEN: u8 = 2;

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn tag(out: &mut Vec<u8>, field: u64, wire: u8) {
    varint(out, (field << 3) | wire as u64);
}

/// A length-delimited field.
fn bytes(out: &mut Vec<u8>, field: u64, b: &[u8]) {
    tag(out, field, LEN);
    varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unhex(s: &str) -> Vec<u8> {
        s.split_whitespace().map(|b| u8::from_str_radix(b, 16).unwrap()).collect()
    }

    #[test]
    fn one_device_options_are_portable() {
        // executable_build_options { device_ordinal: -1, num_replicas: 1, num_partitions: 1 }, portable.
        let want = unhex("1a 0f 08 ff ff ff ff ff ff ff ff ff 01 20 01 28 01 20 01");
        assert_eq!(CompileOptions::single().encode(), want);
    }

    // The golden bytes below are options the XLA:CPU plugin accepted and ran
    // correctly with (`../shared/notes/pjrt-spmd.md`).
    #[test]
    fn spmd_options_match_the_bytes_the_plugin_accepted() {
        let mut gspmd = CompileOptions::spmd(&[0, 1, 2, 3]);
        gspmd.shardy = false;
        let want = "1a 2b 08 ff ff ff ff ff ff ff ff ff 01 20 01 28 04 30 01 4a 18 08 01 10 04 \
                    1a 03 0a 01 00 1a 03 0a 01 01 1a 03 0a 01 02 1a 03 0a 01 03";
        assert_eq!(gspmd.encode(), unhex(want));
        let shardy = "1a 2e 08 ff ff ff ff ff ff ff ff ff 01 20 01 28 04 30 01 4a 18 08 01 10 04 \
                      1a 03 0a 01 00 1a 03 0a 01 01 1a 03 0a 01 02 1a 03 0a 01 03 98 01 01";
        assert_eq!(CompileOptions::spmd(&[0, 1, 2, 3]).encode(), unhex(shardy));
        assert_eq!(CompileOptions::spmd(&[0, 1, 2, 3]).num_devices(), 4);
    }

    #[test]
    fn replicated_options_list_every_replica_in_one_computation() {
        let o = CompileOptions {
            replicas: 4,
            partitions: 1,
            spmd: false,
            shardy: false,
            portable: false,
            assignment: Some(vec![vec![0], vec![1], vec![2], vec![3]]),
        };
        let want = "1a 1d 08 ff ff ff ff ff ff ff ff ff 01 20 04 28 01 4a 0c 08 04 10 01 1a 06 0a 04 00 01 02 03";
        assert_eq!(o.encode(), unhex(want));
    }

    #[test]
    fn large_device_ids_are_varints() {
        // Process 1's devices start at id 2048 on XLA:CPU.
        let e = CompileOptions::spmd(&[2048, 2049]).encode();
        let mut id = vec![];
        varint(&mut id, 2048);
        assert_eq!(id, vec![0x80, 0x10]);
        assert!(e.windows(4).any(|w| w == [0x0a, 0x02, 0x80, 0x10]), "{e:02x?}");
    }
}
