//! The release files of `scripts/release.sh`: the binary needs no glibc newer than 2.17 (its
//! symbol versions, read with readelf), and the .deb holds what README "Packages" says and
//! installs, upgrades, keeps an edited environment file, removes and purges in a throwaway
//! root (`dpkg --root` with `--force-script-chrootless`, so its maintainer scripts run too,
//! writing the system user into that root).
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
        Release {
            deb: debs[0].clone(),
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
    // SHA256SUMS covers the binary, the .deb and the tarball.
    let sums = run(Command::new("sha256sum")
        .arg("-c")
        .arg("SHA256SUMS")
        .current_dir(&r.dir));
    assert_eq!(
        sums.lines().filter(|l| l.ends_with(": OK")).count(),
        3,
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
        unit.contains("\nExecStart=/usr/bin/worker --threads 8 $WORKER_ARGS\n"),
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

/// Hosts without dpkg (RHEL/CentOS 7) get a tarball: the binary with install.sh, which finds
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
    let _ = std::fs::remove_dir_all(&dir);
}
