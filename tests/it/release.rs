//! The release files of `scripts/release.sh`: the binary needs no glibc newer than 2.17 (its
//! symbol versions, read with readelf), and the .deb holds what docs/operating.md "Packages" says and
//! installs, upgrades, keeps an edited environment file, removes and purges in a throwaway
//! root (`dpkg --root` with `--force-script-chrootless`, so its maintainer scripts run too,
//! writing the system user into that root). The RPM requires nothing EL7 lacks and installs,
//! upgrades (to a release 2 packed here by `scripts/rpm/build.sh`) and erases in a throwaway
//! root with Debian's `rpm --root`, whose scriptlets run chrooted in that root: it holds a
//! shell, getent, groupadd and useradd, and a stand-in systemctl where systemd is to seem to
//! run.
//!
//! A glibc 2.17 build takes minutes of CPU, so the test command starts release.sh in the
//! background at its beginning (`scripts/test.sh`, with the quick `glibc-check` profile)
//! and names its directory in DW_RELEASE_CHECK; these tests wait for it. Run without it
//! (`cargo test --test it release`), the first of them runs release.sh itself.

use crate::support::*;
use std::collections::BTreeSet;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
/// Longest wait for the background release build of the test command.
const BUILD_WAIT: Duration = Duration::from_secs(20 * 60);

/// What release.sh made.
struct Release {
    dir: PathBuf,
    deb: PathBuf,
    rpm: PathBuf,
}

fn said(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(out.status.success(), "{cmd:?} failed:\n{}", said(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Waits for the test command's background release.sh (DW_RELEASE_CHECK=DIR: it writes
/// DIR/log, then DIR/rc), or runs it here into target/release-check.
fn release() -> &'static Release {
    static RELEASE: OnceLock<Release> = OnceLock::new();
    RELEASE.get_or_init(|| {
        let check = match std::env::var_os("DW_RELEASE_CHECK") {
            Some(dir) => PathBuf::from(dir),
            None => {
                let check = Path::new(ROOT).join("target/release-check");
                std::fs::create_dir_all(&check).unwrap();
                let _ = std::fs::remove_file(check.join("rc"));
                let log = std::fs::File::create(check.join("log")).unwrap();
                let status = Command::new("bash")
                    .arg(Path::new(ROOT).join("scripts/release.sh"))
                    .args(["--profile", "glibc-check", "--out"])
                    .arg(check.join("dist"))
                    .env("CARGO_TARGET_DIR", check.join("build"))
                    .stdin(Stdio::null())
                    .stdout(log.try_clone().unwrap())
                    .stderr(log)
                    .status()
                    .expect("run scripts/release.sh");
                std::fs::write(
                    check.join("rc"),
                    format!("{}\n", status.code().unwrap_or(-1)),
                )
                .unwrap();
                check
            }
        };
        let start = Instant::now();
        let rc = loop {
            if let Ok(rc) = std::fs::read_to_string(check.join("rc")) {
                break rc;
            }
            assert!(
                start.elapsed() < BUILD_WAIT,
                "release.sh did not finish within {BUILD_WAIT:?}; its log so far:\n{}",
                std::fs::read_to_string(check.join("log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(500));
        };
        let log = std::fs::read_to_string(check.join("log")).unwrap_or_default();
        assert_eq!(rc.trim(), "0", "scripts/release.sh failed:\n{log}");
        let dir = check.join("dist");
        let debs: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "deb"))
            .collect();
        assert_eq!(debs.len(), 1, "not one .deb in {}: {debs:?}", dir.display());
        let rpms: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "rpm"))
            .collect();
        assert_eq!(rpms.len(), 1, "not one .rpm in {}: {rpms:?}", dir.display());
        Release {
            deb: debs[0].clone(),
            rpm: rpms[0].clone(),
            dir,
        }
    })
}

/// The `GLIBC_x.y[.z]` versions an ELF file needs, as numbers.
fn glibc_versions(path: &Path) -> BTreeSet<Vec<u32>> {
    let text = run(Command::new("readelf")
        .args(["--version-info", "--wide"])
        .arg(path));
    text.split(|c: char| c.is_whitespace())
        .filter_map(|w| w.strip_prefix("GLIBC_"))
        .filter_map(|v| v.split('.').map(|n| n.parse().ok()).collect())
        .collect()
}

#[test]
fn release_binary_needs_glibc_2_17_at_most_and_runs() {
    let r = release();
    let binary = r.dir.join("worker");
    let versions = glibc_versions(&binary);
    assert!(
        versions.contains(&vec![2, 2, 5]),
        "readelf lists no GLIBC_2.2.5 (the x86_64 baseline): {versions:?}"
    );
    let newest = versions.last().unwrap();
    assert!(
        *newest <= vec![2, 17],
        "{} needs GLIBC_{newest:?}, newer than 2.17",
        binary.display()
    );
    let version = run(Command::new(&binary).arg("--version"));
    assert_eq!(
        version.trim(),
        format!("worker {}", env!("CARGO_PKG_VERSION")),
        "{version}"
    );
    // SHA256SUMS covers the binary, the .deb, the .rpm and the tarball.
    let sums = run(Command::new("sha256sum")
        .arg("-c")
        .arg("SHA256SUMS")
        .current_dir(&r.dir));
    assert_eq!(
        sums.lines().filter(|l| l.ends_with(": OK")).count(),
        4,
        "{sums}"
    );
}

#[test]
fn release_deb_holds_the_binary_the_unit_and_the_environment_file() {
    let r = release();
    let info = run(Command::new("dpkg-deb").arg("--info").arg(&r.deb));
    for field in [
        "Package: delay-worker",
        &format!("Version: {}-1", env!("CARGO_PKG_VERSION")),
        "Architecture: amd64",
        "libc6 (>= 2.17)",
        " postinst",
        " prerm",
        " postrm",
        " conffiles",
    ] {
        assert!(
            info.contains(field),
            "dpkg-deb --info has no {field:?}:\n{info}"
        );
    }
    let ctrl = temp_dir("dw-deb-control");
    run(Command::new("dpkg-deb").arg("-e").arg(&r.deb).arg(&ctrl));
    assert_eq!(
        std::fs::read_to_string(ctrl.join("conffiles"))
            .unwrap()
            .trim(),
        "/etc/delay-worker/worker.env"
    );
    let _ = std::fs::remove_dir_all(&ctrl);

    // Each line: mode, owner/group (numeric), size, date, time, path.
    let contents = run(Command::new("dpkg-deb").arg("--contents").arg(&r.deb));
    let entry = |path: &str| -> (String, String) {
        let line = contents
            .lines()
            .find(|l| {
                l.split_whitespace().last().is_some_and(|p| {
                    p.trim_start_matches(['.', '/']) == path.trim_start_matches('/')
                })
            })
            .unwrap_or_else(|| panic!("the .deb has no {path}:\n{contents}"));
        let mut f = line.split_whitespace();
        (f.next().unwrap().to_string(), f.next().unwrap().to_string())
    };
    assert_eq!(
        entry("/usr/bin/worker"),
        ("-rwxr-xr-x".into(), "0/0".into())
    );
    assert_eq!(
        entry("/usr/lib/systemd/system/delay-worker.service"),
        ("-rw-r--r--".into(), "0/0".into())
    );
    assert_eq!(
        entry("/etc/delay-worker/worker.env"),
        ("-rw-------".into(), "0/0".into())
    );
}

fn temp_dir(prefix: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("{prefix}-{}-{}", std::process::id(), free_port()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A directory dpkg can install into: its database and the user files useradd writes.
struct DpkgRoot(PathBuf);

impl DpkgRoot {
    fn new() -> DpkgRoot {
        let root = temp_dir("dw-dpkg-root");
        for d in [
            "etc",
            "var/lib/dpkg/info",
            "var/lib/dpkg/updates",
            "var/lib/dpkg/triggers",
        ] {
            std::fs::create_dir_all(root.join(d)).unwrap();
        }
        for (f, text) in [
            ("var/lib/dpkg/status", ""),
            ("var/lib/dpkg/available", ""),
            ("etc/passwd", "root:x:0:0:root:/root:/bin/bash\n"),
            ("etc/group", "root:x:0:\n"),
            ("etc/shadow", "root:*:19000:0:99999:7:::\n"),
            ("etc/gshadow", "root:*::\n"),
        ] {
            std::fs::write(root.join(f), text).unwrap();
        }
        DpkgRoot(root)
    }

    fn path(&self, p: &str) -> PathBuf {
        self.0.join(p.trim_start_matches('/'))
    }

    /// dpkg on this root; its maintainer scripts run here with DPKG_ROOT set. Dependencies
    /// (libc6, passwd) are this host's, not in the root's empty database.
    fn dpkg(&self, args: &[&str]) -> Output {
        let mut cmd = Command::new("dpkg");
        cmd.arg(format!("--root={}", self.0.display()))
            .args(["--force-script-chrootless", "--force-depends"])
            .args(args)
            .stdin(Stdio::null());
        let out = cmd.output().expect("run dpkg");
        assert!(out.status.success(), "{cmd:?} failed:\n{}", said(&out));
        out
    }

    fn read(&self, p: &str) -> String {
        std::fs::read_to_string(self.path(p)).unwrap_or_else(|e| panic!("{p}: {e}"))
    }
}

impl Drop for DpkgRoot {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn mode_and_owner(path: &Path) -> (u32, u32, u32) {
    let m = std::fs::metadata(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    (m.permissions().mode() & 0o7777, m.uid(), m.gid())
}

#[test]
fn release_deb_installs_upgrades_keeps_the_edited_env_file_and_purges() {
    let r = release();
    let deb = r.deb.to_str().unwrap();
    let root = DpkgRoot::new();

    // First install: files, modes, the user.
    root.dpkg(&["--install", deb]);
    assert_eq!(mode_and_owner(&root.path("/usr/bin/worker")), (0o755, 0, 0));
    let version = run(Command::new(root.path("/usr/bin/worker")).arg("--version"));
    assert!(version.starts_with("worker "), "{version}");
    let unit = root.read("/usr/lib/systemd/system/delay-worker.service");
    assert!(
        unit.contains("\nExecStart=/usr/bin/worker $WORKER_ARGS\n"),
        "{unit}"
    );
    assert!(!unit.contains("/usr/local/bin/worker"), "{unit}");
    assert_eq!(
        mode_and_owner(&root.path("/etc/delay-worker/worker.env")),
        (0o600, 0, 0)
    );
    assert_eq!(
        root.read("/etc/delay-worker/worker.env"),
        std::fs::read_to_string(Path::new(ROOT).join("scripts/worker.env")).unwrap()
    );
    let users = |root: &DpkgRoot| -> Vec<String> {
        root.read("/etc/passwd")
            .lines()
            .filter(|l| l.starts_with("delay-worker:"))
            .map(String::from)
            .collect()
    };
    let user = users(&root);
    assert_eq!(user.len(), 1, "{user:?}");
    let f: Vec<&str> = user[0].split(':').collect();
    let uid: u32 = f[2].parse().unwrap();
    assert!(uid > 0 && uid < 1000, "not a system user: {}", user[0]);
    assert_eq!(
        &f[5..],
        ["/nonexistent", "/usr/sbin/nologin"],
        "{}",
        user[0]
    );
    assert!(
        root.read("/etc/group")
            .lines()
            .any(|l| l.starts_with(&format!("delay-worker:x:{}:", f[3]))),
        "no group delay-worker"
    );

    // The operator fills in the file; an upgrade (the same package again) keeps it and the user.
    let filled =
        "REDIS_URL=redis://:secret@10.0.0.5:6379/0\nDATABASE_URL=postgres://shop@db/shop\n";
    std::fs::write(root.path("/etc/delay-worker/worker.env"), filled).unwrap();
    root.dpkg(&["--install", deb]);
    assert_eq!(root.read("/etc/delay-worker/worker.env"), filled);
    assert_eq!(
        mode_and_owner(&root.path("/etc/delay-worker/worker.env")),
        (0o600, 0, 0)
    );
    assert_eq!(users(&root), user, "the upgrade touched the user");

    // Remove keeps the conffile, purge takes it; the user stays.
    root.dpkg(&["--remove", "delay-worker"]);
    assert!(!root.path("/usr/bin/worker").exists());
    assert!(!root
        .path("/usr/lib/systemd/system/delay-worker.service")
        .exists());
    assert_eq!(root.read("/etc/delay-worker/worker.env"), filled);
    root.dpkg(&["--purge", "delay-worker"]);
    assert!(!root.path("/etc/delay-worker/worker.env").exists());
    assert!(!root.path("/etc/delay-worker").exists());
    assert_eq!(users(&root), user);
    let status = root.read("/var/lib/dpkg/status");
    assert!(
        !status.contains("Package: delay-worker"),
        "still in the dpkg database:\n{status}"
    );
}

/// A host installed by copying (scripts/install.sh BINARY) already has its environment
/// file; install.sh installs the .deb with --force-confold, which keeps it as it is.
#[test]
fn release_deb_over_a_copy_install_keeps_its_environment_file() {
    let r = release();
    let root = DpkgRoot::new();
    let before = "DATABASE_URL=postgres://shop@db/shop\n";
    std::fs::create_dir_all(root.path("/etc/delay-worker")).unwrap();
    std::fs::write(root.path("/etc/delay-worker/worker.env"), before).unwrap();
    std::fs::set_permissions(
        root.path("/etc/delay-worker/worker.env"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    root.dpkg(&["--install", "--force-confold", r.deb.to_str().unwrap()]);
    assert_eq!(root.read("/etc/delay-worker/worker.env"), before);
    assert!(root.path("/usr/bin/worker").exists());

    // install.sh takes the .deb where dpkg exists, with the same flag.
    let out = Command::new("bash")
        .arg(Path::new(ROOT).join("scripts/install.sh"))
        .arg("--dry-run")
        .arg(&r.deb)
        .output()
        .unwrap();
    let text = said(&out);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains(&format!("+ dpkg -i --force-confold {}", r.deb.display())),
        "{text}"
    );
    assert!(!text.contains("useradd"), "{text}");
}

/// Hosts with neither dpkg nor rpm get a tarball: the binary with install.sh, which finds
/// the unit and the environment file template beside itself.
#[test]
fn release_tarball_carries_the_binary_and_install_sh() {
    let r = release();
    let name = format!("delay-worker-{}-x86_64-linux", env!("CARGO_PKG_VERSION"));
    let dir = temp_dir("dw-tarball");
    run(Command::new("tar")
        .arg("-xzf")
        .arg(r.dir.join(format!("{name}.tar.gz")))
        .arg("-C")
        .arg(&dir));
    let top = dir.join(&name);
    for (file, mode) in [
        ("worker", 0o755),
        ("install.sh", 0o755),
        ("worker.service", 0o644),
        ("worker.env", 0o644),
    ] {
        assert_eq!(mode_and_owner(&top.join(file)).0, mode, "{file}");
    }
    assert_eq!(
        std::fs::read(top.join("worker")).unwrap(),
        std::fs::read(r.dir.join("worker")).unwrap(),
        "the tarball's binary is not the released one"
    );
    let out = Command::new("bash")
        .arg("install.sh")
        .args(["--dry-run", "./worker"])
        .current_dir(&top)
        .output()
        .unwrap();
    let text = said(&out);
    assert!(out.status.success(), "{text}");
    for step in [
        "install -D -m 0755 -o root -g root ./worker /usr/local/bin/worker",
        &format!("{}/worker.env /etc/delay-worker/worker.env", top.display()),
        &format!(
            "{}/worker.service /etc/systemd/system/delay-worker.service",
            top.display()
        ),
    ] {
        assert!(text.contains(step), "no {step:?} in:\n{text}");
    }
    // Without a file named, install.sh in the tarball installs the binary beside it.
    let out = Command::new("bash")
        .arg("./install.sh")
        .arg("--dry-run")
        .current_dir(&top)
        .output()
        .unwrap();
    let text = said(&out);
    assert!(out.status.success(), "{text}");
    let step = format!(
        "install -D -m 0755 -o root -g root {}/worker /usr/local/bin/worker",
        top.display()
    );
    assert!(text.contains(&step), "no {step:?} in:\n{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

// ---- the RPM ----------------------------------------------------------------------------

/// The features of EL7's rpm (4.11.3: `rpm --showrc`, "Features supported by rpmlib"), the
/// only `rpmlib(...)` requirements a package for it may carry.
const EL7_RPMLIB: &[&str] = &[
    "BuiltinLuaScripts",
    "CompressedFileNames",
    "ConcurrentAccess",
    "ExplicitPackageProvide",
    "FileCaps",
    "FileDigests",
    "HeaderLoadSortsTags",
    "PartialHardlinkSets",
    "PayloadFilesHavePrefix",
    "PayloadIsBzip2",
    "PayloadIsLzma",
    "PayloadIsXz",
    "ScriptletExpansion",
    "ScriptletInterpreterArgs",
    "TildeInVersions",
    "VersionedDependencies",
];

/// `rpm -qp ARGS FILE`: what rpm reads in a package file.
fn rpm_query(file: &Path, args: &[&str]) -> String {
    run(Command::new("rpm")
        .arg("--force-debian")
        .arg("-qp")
        .args(args)
        .arg(file))
}

#[test]
fn release_rpm_holds_the_binary_the_unit_and_the_environment_file_for_el7() {
    let r = release();
    let version = env!("CARGO_PKG_VERSION");
    assert_eq!(
        r.rpm.file_name().unwrap().to_str().unwrap(),
        format!("delay-worker-{version}-1.x86_64.rpm")
    );
    assert_eq!(
        rpm_query(
            &r.rpm,
            &[
                "--qf",
                "%{NAME} %{VERSION} %{RELEASE} %{ARCH} %{PAYLOADCOMPRESSOR} %{LICENSE}"
            ]
        ),
        format!("delay-worker {version} 1 x86_64 gzip MIT")
    );

    // Requirements: what every EL7 host has, and rpmlib features its rpm 4.11 knows.
    let requires = rpm_query(&r.rpm, &["--requires"]);
    let mut named = BTreeSet::new();
    for line in requires.lines() {
        match line.strip_prefix("rpmlib(") {
            Some(rest) => {
                let feature = rest.split(')').next().unwrap();
                assert!(
                    EL7_RPMLIB.contains(&feature),
                    "the RPM requires {line}, which EL7's rpm 4.11 lacks:\n{requires}"
                );
            }
            None => {
                named.insert(line);
            }
        }
    }
    assert_eq!(
        named,
        BTreeSet::from(["/bin/sh", "glibc >= 2.17", "glibc-common", "shadow-utils"]),
        "{requires}"
    );

    // Files: path, flags (c = config, n = noreplace), mode, owner, group.
    let files = rpm_query(
        &r.rpm,
        &[
            "--qf",
            "[%{FILENAMES} %{FILEFLAGS:fflags} %{FILEMODES:perms} %{FILEUSERNAME} %{FILEGROUPNAME}\n]",
        ],
    );
    let files: BTreeSet<Vec<&str>> = files
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(
        files,
        BTreeSet::from([
            vec!["/etc/delay-worker", "drwxr-xr-x", "root", "root"],
            vec![
                "/etc/delay-worker/worker.env",
                "cn",
                "-rw-------",
                "root",
                "root"
            ],
            vec!["/usr/bin/worker", "-rwxr-xr-x", "root", "root"],
            vec![
                "/usr/lib/systemd/system/delay-worker.service",
                "-rw-r--r--",
                "root",
                "root"
            ],
        ])
    );
    // The binary is the released one (rpm records each file's SHA-256).
    let digests = rpm_query(&r.rpm, &["--qf", "[%{FILENAMES} %{FILEDIGESTS}\n]"]);
    let packed = digests
        .lines()
        .find_map(|l| l.strip_prefix("/usr/bin/worker "))
        .unwrap_or_else(|| panic!("{digests}"));
    let released = run(Command::new("sha256sum").arg(r.dir.join("worker")));
    assert_eq!(
        Some(packed),
        released.split_whitespace().next(),
        "the RPM's binary is not the released one"
    );
    // The digests EL7's rpm checks (rpm -K: MD5 and the header's SHA-1) are there and hold.
    let checked = run(Command::new("rpmkeys").arg("-Kv").arg(&r.rpm));
    for digest in [
        "Header SHA1 digest: OK",
        "MD5 digest: OK",
        "Payload SHA256 digest: OK",
    ] {
        assert!(checked.contains(digest), "no {digest:?}:\n{checked}");
    }
    let scripts = rpm_query(&r.rpm, &["--scripts"]);
    for kind in ["preinstall", "postinstall", "preuninstall", "postuninstall"] {
        assert!(
            scripts.contains(&format!("{kind} scriptlet (using /bin/sh):")),
            "no {kind} scriptlet:\n{scripts}"
        );
    }
}

/// The programs an EL7 host has that the scriptlets may run (glibc-common's getent,
/// shadow-utils' groupadd and useradd) and the shell, at their EL7 paths.
const SCRIPTLET_TOOLS: &[&str] = &[
    "/usr/bin/sh",
    "/usr/bin/getent",
    "/usr/sbin/groupadd",
    "/usr/sbin/useradd",
];

/// What of systemd a throwaway root has.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Systemd {
    /// No systemctl at all (a minimal container).
    Absent,
    /// systemctl (a stand-in) but no running systemd: an image built with systemd, or a
    /// chroot.
    Installed,
    /// systemctl and /run/systemd/system, as where systemd is PID 1.
    Running,
}

/// A throwaway root for `rpm --root`, laid out as a merged-/usr EL host. rpm runs the
/// scriptlets chrooted in it, so it holds the shell and the tools of [`SCRIPTLET_TOOLS`]
/// (this host's, with their libraries) and nothing else: a scriptlet that ran anything
/// more would fail here. Its systemctl, where it has one, is a stand-in that writes its
/// arguments to /var/log/systemctl, one call a line.
struct RpmRoot(PathBuf);

impl RpmRoot {
    fn new(systemd: Systemd) -> RpmRoot {
        let root = RpmRoot(temp_dir("dw-rpm-root"));
        for d in [
            "etc",
            "dev",
            "tmp",
            "var/tmp",
            "var/log",
            "var/lib/rpm",
            "usr/bin",
            "usr/sbin",
            "usr/lib",
            "usr/lib64",
        ] {
            std::fs::create_dir_all(root.path(d)).unwrap();
        }
        for (link, to) in [
            ("bin", "usr/bin"),
            ("sbin", "usr/sbin"),
            ("lib", "usr/lib"),
            ("lib64", "usr/lib64"),
        ] {
            std::os::unix::fs::symlink(to, root.path(link)).unwrap();
        }
        for (f, text) in [
            ("etc/passwd", "root:x:0:0:root:/root:/bin/sh\n"),
            ("etc/group", "root:x:0:\n"),
            ("etc/shadow", "root:*:19000:0:99999:7:::\n"),
            ("etc/gshadow", "root:*::\n"),
            (
                "etc/nsswitch.conf",
                "passwd: files\ngroup: files\nshadow: files\n",
            ),
            // util-linux's on EL7; useradd only checks that the shell is there.
            ("usr/sbin/nologin", "#!/bin/sh\nexit 1\n"),
        ] {
            std::fs::write(root.path(f), text).unwrap();
        }
        std::fs::set_permissions(
            root.path("usr/sbin/nologin"),
            std::fs::Permissions::from_mode(0o755),
        )
        .unwrap();
        // Scriptlets send output to /dev/null.
        let null = std::ffi::CString::new(root.path("dev/null").to_str().unwrap()).unwrap();
        let rc = unsafe { libc::mknod(null.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) };
        assert_eq!(
            rc,
            0,
            "mknod /dev/null in the throwaway root (needs root): {}",
            std::io::Error::last_os_error()
        );
        std::fs::set_permissions(
            root.path("dev/null"),
            std::fs::Permissions::from_mode(0o666),
        )
        .unwrap();
        for tool in SCRIPTLET_TOOLS {
            root.copy_in(tool);
        }
        if systemd == Systemd::Running {
            std::fs::create_dir_all(root.path("run/systemd/system")).unwrap();
        }
        if systemd != Systemd::Absent {
            std::fs::write(
                root.path("usr/bin/systemctl"),
                "#!/bin/sh\necho \"$*\" >>/var/log/systemctl\n",
            )
            .unwrap();
            std::fs::set_permissions(
                root.path("usr/bin/systemctl"),
                std::fs::Permissions::from_mode(0o755),
            )
            .unwrap();
        }
        root
    }

    fn path(&self, p: &str) -> PathBuf {
        self.0.join(p.trim_start_matches('/'))
    }

    /// Copies a program of this host and the libraries `ldd` names for it to the same
    /// paths in the root.
    fn copy_in(&self, program: &str) {
        let copy = |from: &str| {
            let to = self.path(from);
            std::fs::create_dir_all(to.parent().unwrap()).unwrap();
            std::fs::copy(from, &to).unwrap_or_else(|e| panic!("copy {from} into the root: {e}"));
        };
        assert!(
            Path::new(program).exists(),
            "{program} is missing on this host (the RPM test runs it in a throwaway root)"
        );
        copy(program);
        let libs = run(Command::new("ldd").arg(program));
        for lib in libs.split_whitespace().filter(|w| w.starts_with('/')) {
            copy(lib);
        }
    }

    /// `rpm --root` on this root, with its own database.
    fn cmd(&self) -> Command {
        let mut cmd = Command::new("rpm");
        cmd.arg("--force-debian")
            .arg("--root")
            .arg(&self.0)
            .args(["--dbpath", "/var/lib/rpm"])
            .stdin(Stdio::null());
        cmd
    }

    /// rpm on this root; install, upgrade, erase and verify with `--nodeps`: the
    /// dependencies (glibc, shadow-utils) are an EL host's, not in the root's empty
    /// database. Returns what rpm said.
    fn rpm(&self, args: &[&str]) -> String {
        let mut cmd = self.cmd();
        if matches!(args[0], "-U" | "-e" | "-V") {
            cmd.arg("--nodeps");
        }
        cmd.args(args);
        let out = cmd.output().expect("run rpm (Debian's rpm package)");
        assert!(out.status.success(), "{cmd:?} failed:\n{}", said(&out));
        said(&out).trim().to_string()
    }

    fn read(&self, p: &str) -> String {
        std::fs::read_to_string(self.path(p)).unwrap_or_else(|e| panic!("{p}: {e}"))
    }

    /// The lines of /etc/passwd for the delay-worker user.
    fn users(&self) -> Vec<String> {
        self.read("/etc/passwd")
            .lines()
            .filter(|l| l.starts_with("delay-worker:"))
            .map(String::from)
            .collect()
    }

    /// What the stand-in systemctl was asked, since the last look.
    fn systemctl_calls(&self) -> Vec<String> {
        let log = self.path("/var/log/systemctl");
        let calls = std::fs::read_to_string(&log).unwrap_or_default();
        let _ = std::fs::remove_file(&log);
        calls.lines().map(String::from).collect()
    }
}

impl Drop for RpmRoot {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The release 2 of the RPM, packed once by `scripts/rpm/build.sh` from the released binary,
/// the unit made as release.sh makes it and a template with one line more: an upgrade.
fn rpm_release_2() -> &'static Path {
    static RPM: OnceLock<PathBuf> = OnceLock::new();
    RPM.get_or_init(|| {
        let r = release();
        // Under the target directory, one per test process (a static is never dropped):
        // the packages of processes that have ended are removed here.
        let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
        for old in std::fs::read_dir(tmp).into_iter().flatten().flatten() {
            let name = old.file_name().to_string_lossy().into_owned();
            let pid = name.strip_prefix("dw-rpm-release-2-");
            if pid.is_some_and(|p| !Path::new("/proc").join(p).exists()) {
                let _ = std::fs::remove_dir_all(old.path());
            }
        }
        let dir = tmp.join(format!("dw-rpm-release-2-{}", std::process::id()));
        let stage = dir.join("stage");
        std::fs::create_dir_all(&stage).unwrap();
        std::fs::copy(r.dir.join("worker"), stage.join("worker")).unwrap();
        std::fs::write(stage.join("delay-worker.service"), packaged_unit()).unwrap();
        std::fs::write(stage.join("worker.env"), release_2_template()).unwrap();
        let out = run(Command::new("bash")
            .arg(Path::new(ROOT).join("scripts/rpm/build.sh"))
            .arg("--stage")
            .arg(&stage)
            .arg("--out")
            .arg(dir.join("out"))
            .args(["--release", "2"]));
        let rpm = PathBuf::from(out.trim());
        assert_eq!(
            rpm.file_name().unwrap().to_str().unwrap(),
            format!("delay-worker-{}-2.x86_64.rpm", env!("CARGO_PKG_VERSION"))
        );
        // The staged binary's copy is packed: only the package is kept.
        let _ = std::fs::remove_dir_all(&stage);
        rpm
    })
}

/// scripts/worker.service as the packages carry it: ExecStart=/usr/bin/worker.
fn packaged_unit() -> String {
    let unit = std::fs::read_to_string(Path::new(ROOT).join("scripts/worker.service")).unwrap();
    assert!(unit.contains("\nExecStart=/usr/local/bin/worker "));
    unit.replace(
        "\nExecStart=/usr/local/bin/worker ",
        "\nExecStart=/usr/bin/worker ",
    )
}

fn template() -> String {
    std::fs::read_to_string(Path::new(ROOT).join("scripts/worker.env")).unwrap()
}

fn release_2_template() -> String {
    template() + "# a line release 2 of the package adds to the template\n"
}

const ENV: &str = "/etc/delay-worker/worker.env";

#[test]
fn release_rpm_installs_upgrades_keeps_the_edited_env_file_and_erases() {
    let r = release();
    let root = RpmRoot::new(Systemd::Absent);
    let v = env!("CARGO_PKG_VERSION");

    // First install: nothing said (no scriptlet failed, nothing missing), files and modes,
    // the user from %pre.
    assert_eq!(root.rpm(&["-U", r.rpm.to_str().unwrap()]), "");
    assert_eq!(
        root.rpm(&["-q", "delay-worker"]),
        format!("delay-worker-{v}-1.x86_64")
    );
    assert_eq!(mode_and_owner(&root.path("/usr/bin/worker")), (0o755, 0, 0));
    let version = run(Command::new(root.path("/usr/bin/worker")).arg("--version"));
    assert_eq!(version.trim(), format!("worker {v}"));
    assert_eq!(
        root.read("/usr/lib/systemd/system/delay-worker.service"),
        packaged_unit()
    );
    assert_eq!(
        mode_and_owner(&root.path("/usr/lib/systemd/system/delay-worker.service")),
        (0o644, 0, 0)
    );
    assert_eq!(
        mode_and_owner(&root.path("/etc/delay-worker")),
        (0o755, 0, 0)
    );
    assert_eq!(mode_and_owner(&root.path(ENV)), (0o600, 0, 0));
    assert_eq!(root.read(ENV), template());
    // rpm's own check of every file's digest, mode and owner: all as packed.
    assert_eq!(root.rpm(&["-V", "delay-worker"]), "");
    let user = root.users();
    assert_eq!(user.len(), 1, "{user:?}");
    let f: Vec<&str> = user[0].split(':').collect();
    let uid: u32 = f[2].parse().unwrap();
    assert!(uid > 0 && uid < 1000, "not a system user: {}", user[0]);
    assert_eq!(
        &f[4..],
        ["delay-worker service", "/nonexistent", "/usr/sbin/nologin"],
        "{}",
        user[0]
    );
    assert!(
        root.read("/etc/group")
            .lines()
            .any(|l| l.starts_with(&format!("delay-worker:x:{}:", f[3]))),
        "no group delay-worker"
    );

    // The operator fills in the file; the upgrade to release 2 (whose template differs)
    // keeps it and writes the new template beside it as .rpmnew.
    let filled =
        "REDIS_URL=redis://:secret@10.0.0.5:6379/0\nDATABASE_URL=postgres://shop@db/shop\n";
    std::fs::write(root.path(ENV), filled).unwrap();
    let told = root.rpm(&["-U", rpm_release_2().to_str().unwrap()]);
    assert_eq!(told, format!("warning: {ENV} created as {ENV}.rpmnew"));
    assert_eq!(
        root.rpm(&["-q", "delay-worker"]),
        format!("delay-worker-{v}-2.x86_64")
    );
    assert_eq!(root.read(ENV), filled);
    assert_eq!(mode_and_owner(&root.path(ENV)), (0o600, 0, 0));
    assert_eq!(root.read(&format!("{ENV}.rpmnew")), release_2_template());
    assert_eq!(
        mode_and_owner(&root.path(&format!("{ENV}.rpmnew"))),
        (0o600, 0, 0)
    );
    assert_eq!(root.users(), user, "the upgrade touched the user");
    // Only the edited file differs from the package now.
    let verify = root
        .cmd()
        .args(["--nodeps", "-V", "delay-worker"])
        .output()
        .unwrap();
    let verify = said(&verify);
    assert_eq!(verify.lines().count(), 1, "{verify}");
    assert!(
        verify.trim_end().ends_with(&format!(" c {ENV}")),
        "{verify}"
    );

    // Erase: the files go, the edited environment file is kept as .rpmsave (the .rpmnew,
    // which no package owns, stays too); the user stays.
    let told = root.rpm(&["-e", "delay-worker"]);
    assert_eq!(told, format!("warning: {ENV} saved as {ENV}.rpmsave"));
    assert!(!root.path("/usr/bin/worker").exists());
    assert!(!root
        .path("/usr/lib/systemd/system/delay-worker.service")
        .exists());
    assert!(!root.path(ENV).exists());
    assert_eq!(root.read(&format!("{ENV}.rpmsave")), filled);
    assert!(root.path(&format!("{ENV}.rpmnew")).exists());
    assert_eq!(root.users(), user);
    let out = root.cmd().args(["-q", "delay-worker"]).output().unwrap();
    assert!(!out.status.success(), "still installed: {}", said(&out));
}

/// Under systemd the scriptlets reload the units, restart a running worker after an
/// upgrade and stop and disable it on erase (the stand-in systemctl records the calls); an
/// unedited environment file is replaced by a changed template without a word.
#[test]
fn release_rpm_scriptlets_use_systemctl_where_systemd_runs() {
    let r = release();
    let root = RpmRoot::new(Systemd::Running);
    assert_eq!(root.rpm(&["-U", r.rpm.to_str().unwrap()]), "");
    assert_eq!(root.systemctl_calls(), ["daemon-reload"]);
    assert_eq!(root.users().len(), 1);

    // rpm -U: the new release's %post, then the old one's %preun (nothing on an upgrade)
    // and %postun.
    assert_eq!(root.rpm(&["-U", rpm_release_2().to_str().unwrap()]), "");
    assert_eq!(
        root.systemctl_calls(),
        [
            "daemon-reload",
            "daemon-reload",
            "try-restart delay-worker.service"
        ]
    );
    assert_eq!(root.read(ENV), release_2_template());
    assert!(!root.path(&format!("{ENV}.rpmnew")).exists());

    assert_eq!(root.rpm(&["-e", "delay-worker"]), "");
    assert_eq!(
        root.systemctl_calls(),
        [
            "stop delay-worker.service",
            "--no-reload disable delay-worker.service",
            "daemon-reload"
        ]
    );
    assert!(!root.path(ENV).exists());
    assert!(!root.path(&format!("{ENV}.rpmsave")).exists());
}

/// A host installed by copying (scripts/install.sh BINARY) already has its environment file
/// and its user: the RPM keeps both (the template goes beside the file as .rpmnew). Where
/// systemctl exists but systemd does not run, only the erase calls it (`--no-reload
/// disable`, which works offline). On a host where rpm exists and dpkg does not,
/// install.sh takes the .rpm; where dpkg exists it refuses one.
#[test]
fn release_rpm_over_a_copy_install_keeps_its_environment_file_and_user() {
    let r = release();
    let root = RpmRoot::new(Systemd::Installed);
    let before = "DATABASE_URL=postgres://shop@db/shop\n";
    std::fs::create_dir_all(root.path("/etc/delay-worker")).unwrap();
    std::fs::write(root.path(ENV), before).unwrap();
    std::fs::set_permissions(root.path(ENV), std::fs::Permissions::from_mode(0o600)).unwrap();
    let copied = "delay-worker:x:998:998:delay-worker service:/nonexistent:/usr/sbin/nologin";
    let passwd = root.read("/etc/passwd") + copied + "\n";
    std::fs::write(root.path("/etc/passwd"), passwd).unwrap();
    let group = root.read("/etc/group") + "delay-worker:x:998:\n";
    std::fs::write(root.path("/etc/group"), group).unwrap();
    assert_eq!(
        root.rpm(&["-U", "--replacepkgs", r.rpm.to_str().unwrap()]),
        format!("warning: {ENV} created as {ENV}.rpmnew")
    );
    assert_eq!(root.read(ENV), before);
    assert_eq!(root.read(&format!("{ENV}.rpmnew")), template());
    assert_eq!(root.users(), [copied]);
    assert!(root.path("/usr/bin/worker").exists());
    assert_eq!(root.systemctl_calls(), Vec::<String>::new());
    root.rpm(&["-e", "delay-worker"]);
    assert_eq!(
        root.systemctl_calls(),
        ["--no-reload disable delay-worker.service"]
    );
    assert_eq!(root.read(&format!("{ENV}.rpmsave")), before);

    // install.sh on a host with rpm and without dpkg: a PATH of this host's programs less
    // dpkg's.
    let bin = temp_dir("dw-no-dpkg-path");
    for dir in ["/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin"] {
        for e in std::fs::read_dir(dir).unwrap() {
            let e = e.unwrap();
            let name = e.file_name();
            if name.to_string_lossy().starts_with("dpkg") || bin.join(&name).exists() {
                continue;
            }
            std::os::unix::fs::symlink(e.path(), bin.join(&name)).unwrap();
        }
    }
    let install = |path: &Path| {
        let out = Command::new("/bin/bash")
            .arg(Path::new(ROOT).join("scripts/install.sh"))
            .arg("--dry-run")
            .arg(&r.rpm)
            .env("PATH", path)
            .output()
            .unwrap();
        (out.status.success(), said(&out))
    };
    let (ok, text) = install(&bin);
    let _ = std::fs::remove_dir_all(&bin);
    assert!(ok, "{text}");
    assert!(
        text.contains(&format!("+ rpm -U --replacepkgs {}", r.rpm.display())),
        "{text}"
    );
    assert!(!text.contains("useradd"), "{text}");
    let (ok, text) = install(Path::new(&std::env::var_os("PATH").unwrap()));
    assert!(!ok, "{text}");
    assert!(
        text.contains("this host has dpkg: install the .deb, not the .rpm"),
        "{text}"
    );
}
