//! Just enough of the W3C WebDriver protocol to drive Debian's headless Chromium through
//! `chromedriver`: open a page, find elements by CSS selector, click, type, read text, take
//! screenshots. Installed by `scripts/services` (packages `chromium` and `chromium-driver`).

use base64::Engine;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The key W3C WebDriver names element references by.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// A `chromedriver` process with one browser session; both end on drop.
pub struct Browser {
    driver: std::process::Child,
    base: String,
    session: String,
    http: reqwest::Client,
    _profile: PathBuf,
}

/// An element of the current page.
pub struct Element<'a> {
    browser: &'a Browser,
    id: String,
}

impl Browser {
    /// Starts chromedriver on a spare port and a headless Chromium session (a fresh profile,
    /// no background networking: this machine's network is closed).
    pub async fn start(dir: &Path) -> Self {
        let driver_bin = ["/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver"]
            .into_iter()
            .find(|p| Path::new(p).exists())
            .unwrap_or_else(|| {
                panic!("chromedriver not found: run scripts/services (installs chromium and chromium-driver)")
            });
        assert!(Path::new("/usr/bin/chromium").exists(), "chromium not found: run scripts/services");
        let port = crate::free_port();
        let log = std::fs::File::create(dir.join("chromedriver.log")).unwrap();
        let driver = std::process::Command::new(driver_bin)
            .arg(format!("--port={port}"))
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {driver_bin}: {e}"));
        let base = format!("http://127.0.0.1:{port}");
        let http = reqwest::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
        crate::wait_until("chromedriver answers", Duration::from_secs(30), || {
            let (http, url) = (http.clone(), format!("{base}/status"));
            async move { http.get(url).send().await.is_ok() }
        })
        .await;
        let profile = dir.join(format!("chromium-profile-{port}"));
        std::fs::create_dir_all(&profile).unwrap();
        let args = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
            "--window-size=1400,900",
        ];
        let mut args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        args.push(format!("--user-data-dir={}", profile.display()));
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {"binary": "/usr/bin/chromium", "args": args}
        }}});
        let mut browser = Self { driver, base, session: String::new(), http, _profile: profile };
        let v = browser.call("POST", "/session", Some(caps)).await;
        browser.session = v["sessionId"].as_str().unwrap_or_else(|| panic!("no session: {v}")).to_string();
        browser
    }

    async fn call(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let url = if path == "/session" {
            format!("{}{path}", self.base)
        } else {
            format!("{}/session/{}{path}", self.base, self.session)
        };
        let req = match method {
            "GET" => self.http.get(&url),
            "DELETE" => self.http.delete(&url),
            _ => self
                .http
                .post(&url)
                .header("content-type", "application/json")
                .body(serde_json::to_vec(&body.unwrap_or(json!({}))).unwrap()),
        };
        let resp = req.send().await.unwrap_or_else(|e| panic!("webdriver {method} {path}: {e}"));
        let text = resp.text().await.unwrap_or_default();
        let v: Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("webdriver {path}: {e}: {text}"));
        v.get("value").cloned().unwrap_or(Value::Null)
    }

    /// Opens `url` and waits for it to load.
    pub async fn open(&self, url: &str) {
        let v = self.call("POST", "/url", Some(json!({"url": url}))).await;
        assert!(v.is_null() || v.get("error").is_none(), "open {url}: {v}");
    }

    /// The current page's URL.
    pub async fn url(&self) -> String {
        self.call("GET", "/url", None).await.as_str().unwrap_or_default().to_string()
    }

    /// The first element matching `css`, if any.
    pub async fn find(&self, css: &str) -> Option<Element<'_>> {
        let v = self.call("POST", "/element", Some(json!({"using": "css selector", "value": css}))).await;
        v.get(ELEMENT).and_then(Value::as_str).map(|id| Element { browser: self, id: id.to_string() })
    }

    /// Every element matching `css`.
    pub async fn find_all(&self, css: &str) -> Vec<Element<'_>> {
        let v = self.call("POST", "/elements", Some(json!({"using": "css selector", "value": css}))).await;
        v.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|e| e.get(ELEMENT).and_then(Value::as_str))
                    .map(|id| Element { browser: self, id: id.to_string() })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The element matching `css`, waiting up to 10 s for it (a click may return before the
    /// page it leads to is loaded); panics naming the page when there is none.
    pub async fn get(&self, css: &str) -> Element<'_> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(e) = self.find(css).await {
                return e;
            }
            if tokio::time::Instant::now() >= deadline {
                panic!("no {css:?} on {}:\n{}", self.url().await, self.text().await);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The visible text of the page.
    pub async fn text(&self) -> String {
        match self.find("body").await {
            Some(b) => b.text().await,
            None => String::new(),
        }
    }

    /// The page's HTML as the browser holds it.
    pub async fn source(&self) -> String {
        self.call("GET", "/source", None).await.as_str().unwrap_or_default().to_string()
    }

    /// Reloads `url` until its text contains `needle` (or the deadline passes: a panic with
    /// the last text).
    pub async fn open_until(&self, url: &str, needle: &str, timeout: Duration) -> String {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            self.open(url).await;
            let text = self.text().await;
            if text.contains(needle) {
                return text;
            }
            assert!(tokio::time::Instant::now() < deadline, "{url} never showed {needle:?}; last:\n{text}");
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }

    /// Saves a PNG of the viewport as `<dir>/<name>.png` when `CHIME_SCREENSHOTS` names a
    /// directory (the README's screenshots are taken this way).
    pub async fn screenshot(&self, name: &str) {
        let Some(dir) = std::env::var_os("CHIME_SCREENSHOTS") else { return };
        let v = self.call("GET", "/screenshot", None).await;
        let png = base64::engine::general_purpose::STANDARD.decode(v.as_str().unwrap_or_default()).unwrap();
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(Path::new(&dir).join(format!("{name}.png")), png).unwrap();
    }
}

impl Element<'_> {
    pub async fn click(&self) {
        let v = self.browser.call("POST", &format!("/element/{}/click", self.id), Some(json!({}))).await;
        assert!(v.is_null() || v.get("error").is_none(), "click: {v}");
    }

    pub async fn text(&self) -> String {
        self.browser
            .call("GET", &format!("/element/{}/text", self.id), None)
            .await
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    pub async fn attr(&self, name: &str) -> Option<String> {
        let v = self.browser.call("GET", &format!("/element/{}/attribute/{name}", self.id), None).await;
        v.as_str().map(str::to_string)
    }

    pub async fn type_text(&self, text: &str) {
        let v = self
            .browser
            .call("POST", &format!("/element/{}/value", self.id), Some(json!({"text": text})))
            .await;
        assert!(v.is_null() || v.get("error").is_none(), "type: {v}");
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // Ends the session (chromedriver closes Chromium), then the driver. On a thread of its
        // own: drop may run inside a runtime.
        let url = format!("{}/session/{}", self.base, self.session);
        let _ = std::thread::spawn(move || {
            if let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() {
                rt.block_on(async {
                    let http = reqwest::Client::builder().timeout(Duration::from_secs(20)).build();
                    if let Ok(http) = http {
                        let _ = http.delete(url).send().await;
                    }
                });
            }
        })
        .join();
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}
