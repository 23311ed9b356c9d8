//! The timeline as one self-contained HTML page (no network needed to view it): the data as JSON inside the
//! page and a small script (`page.html`) that draws the tracks as SVG, with wheel zoom and drag to pan.
use super::model::Timeline;

/// The page; `/*BATON_TIMELINE_DATA*/` is replaced by the data.
const PAGE: &str = include_str!("page.html");
const DATA_MARK: &str = "/*BATON_TIMELINE_DATA*/null";

/// Renders `t` as the page.
pub fn render(t: &Timeline) -> anyhow::Result<Vec<u8>> {
    let data = serde_json::to_string(t)?;
    // Inside a <script> element only `</` (a closing tag) and `<!--` can end or change it: escape `<`.
    let data = data.replace('<', "\\u003c");
    Ok(PAGE.replacen(DATA_MARK, &data, 1).into_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_data_is_embedded_and_cannot_close_the_script() {
        let mut t = Timeline::default();
        t.add(&serde_json::json!({"ts_ns": 1, "container": "x</script><b>", "pid": 1, "tid": 1, "event": "exit"}));
        let page = String::from_utf8(render(&t).unwrap()).unwrap();
        assert!(!page.contains(DATA_MARK));
        assert!(page.contains("x\\u003c/script>\\u003cb>"));
        assert_eq!(
            page.matches("</script>").count(),
            PAGE.matches("</script>").count()
        );
    }
}
