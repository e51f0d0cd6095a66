//! `brctl watch`: a live view of one group, refreshed every `--interval` (ratatui on
//! crossterm). Off a terminal (a pipe, a log, a test) it prints the status table (or JSON) at
//! each refresh instead, so it can be recorded.

use std::io::IsTerminal as _;
use std::time::Duration;

use ratatui::Frame;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Block, Borders, Cell, Paragraph, Row, Table};

use crate::model::GroupSummary;
use crate::render::{bar, group_header, group_table, state_label};
use crate::{Ctl, Output};

/// Runs the live view until quit (or `count` refreshes).
pub async fn watch(
    ctl: &Ctl,
    group: &str,
    interval: Duration,
    count: Option<u64>,
    output: Output,
    out: &mut (dyn std::io::Write + Send),
) -> anyhow::Result<()> {
    if output == Output::Json || !std::io::stdout().is_terminal() {
        return print_loop(ctl, group, interval, count, output, out).await;
    }
    let mut terminal = ratatui::init();
    let result = tui_loop(&mut terminal, ctl, group, interval, count).await;
    ratatui::restore();
    result
}

async fn print_loop(
    ctl: &Ctl,
    group: &str,
    interval: Duration,
    count: Option<u64>,
    output: Output,
    out: &mut (dyn std::io::Write + Send),
) -> anyhow::Result<()> {
    let mut n = 0u64;
    loop {
        let view = GroupSummary::of_snapshot(&ctl.snapshot(group).await?);
        match output {
            Output::Json => writeln!(out, "{}", serde_json::to_string(&view)?)?,
            Output::Table => writeln!(out, "{}\n", group_table(&view))?,
        }
        out.flush()?;
        n += 1;
        if count.is_some_and(|c| n >= c) {
            return Ok(());
        }
        tokio::time::sleep(interval).await;
    }
}

async fn tui_loop(
    terminal: &mut ratatui::DefaultTerminal,
    ctl: &Ctl,
    group: &str,
    interval: Duration,
    count: Option<u64>,
) -> anyhow::Result<()> {
    let mut n = 0u64;
    loop {
        // A failed refresh is shown, not fatal: the operator is watching an outage too.
        let state = ctl
            .snapshot(group)
            .await
            .map(|s| GroupSummary::of_snapshot(&s));
        terminal.draw(|f| draw(f, &state, interval))?;
        n += 1;
        if count.is_some_and(|c| n >= c) {
            return Ok(());
        }
        // Wait for the next refresh, answering keys meanwhile (crossterm's poll blocks, so it
        // runs off the runtime's threads).
        let quit = tokio::task::spawn_blocking(move || wait_for_quit(interval)).await??;
        if quit {
            return Ok(());
        }
    }
}

/// Waits up to `interval` for a quit key; true if one came.
fn wait_for_quit(interval: Duration) -> std::io::Result<bool> {
    let deadline = std::time::Instant::now() + interval;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() || !event::poll(left)? {
            return Ok(false);
        }
        if let Event::Key(k) = event::read()?
            && k.kind == KeyEventKind::Press
        {
            let ctrl_c =
                k.modifiers.contains(KeyModifiers::CONTROL) && k.code == KeyCode::Char('c');
            if ctrl_c || matches!(k.code, KeyCode::Char('q') | KeyCode::Esc) {
                return Ok(true);
            }
        }
    }
}

/// One frame: the group's summary line, then a row per rank with its load bar.
pub fn draw(f: &mut Frame, state: &anyhow::Result<GroupSummary>, interval: Duration) {
    let [head, body] =
        Layout::vertical([Constraint::Length(3), Constraint::Min(3)]).areas(f.area());
    let view = match state {
        Ok(v) => v,
        Err(e) => {
            let p = Paragraph::new(format!("refresh failed: {e:#}"))
                .style(Style::default().fg(Color::Red))
                .block(
                    Block::default()
                        .borders(Borders::ALL)
                        .title(" brctl watch "),
                );
            f.render_widget(p, head);
            return;
        }
    };
    let title = format!(
        " brctl watch — every {} — q quits ",
        humantime::format_duration(interval)
    );
    f.render_widget(
        Paragraph::new(Line::from(group_header(view)))
            .block(Block::default().borders(Borders::ALL).title(title)),
        head,
    );
    let bar_width = usize::from(body.width.saturating_sub(70)).clamp(10, 60);
    let rows = view.workers.iter().map(|w| {
        let colour = match (w.liveness, w.cordoned) {
            ("live", false) => Color::Green,
            ("live", true) => Color::Yellow,
            ("suspect", _) => Color::Magenta,
            _ => Color::DarkGray,
        };
        Row::new(vec![
            Cell::from(w.worker_id.to_string()),
            Cell::from(state_label(w.liveness, w.cordoned)).style(Style::default().fg(colour)),
            Cell::from(bar(w.load_tokens, view.max_load_tokens, bar_width)),
            Cell::from(w.load_tokens.to_string()),
            Cell::from(format!("{}/{}", w.running, w.reserved)),
            Cell::from(w.capacity.to_string()),
        ])
    });
    let table = Table::new(
        rows,
        [
            Constraint::Length(7),
            Constraint::Length(16),
            Constraint::Length(bar_width as u16),
            Constraint::Length(10),
            Constraint::Length(12),
            Constraint::Length(9),
        ],
    )
    .header(
        Row::new(vec![
            "WORKER", "STATE", "KV LOAD", "TOKENS", "RUN/RES", "CAPACITY",
        ])
        .style(Style::default().add_modifier(Modifier::BOLD)),
    )
    .block(Block::default().borders(Borders::ALL).title(" ranks "));
    f.render_widget(table, body);
}

#[cfg(test)]
mod tests {
    use super::*;
    use br_proto::v1;
    use ratatui::Terminal;
    use ratatui::backend::TestBackend;

    fn frame_text(state: &anyhow::Result<GroupSummary>) -> String {
        let mut t = Terminal::new(TestBackend::new(120, 12)).unwrap();
        t.draw(|f| draw(f, state, Duration::from_secs(1))).unwrap();
        let buf = t.backend().buffer().clone();
        let mut s = String::new();
        for y in 0..buf.area.height {
            for x in 0..buf.area.width {
                s.push_str(buf[(x, y)].symbol());
            }
            s.push('\n');
        }
        s
    }

    #[test]
    fn the_frame_shows_every_rank_its_state_and_load() {
        let snap = v1::ClusterSnapshot {
            group: "g0".into(),
            epoch: 1,
            version: 5,
            workers: (0..3)
                .map(|i| v1::WorkerState {
                    worker_id: i,
                    incarnation: 1,
                    capacity: 8,
                    liveness: v1::Liveness::Live as i32,
                    cordoned: i == 2,
                    ..Default::default()
                })
                .collect(),
            requests: vec![v1::RequestState {
                request_id: "r".into(),
                worker_id: 1,
                prompt_tokens: 4321,
                state: v1::RequestPhase::Reserved as i32,
                ..Default::default()
            }],
        };
        let text = frame_text(&Ok(GroupSummary::of_snapshot(&snap)));
        assert!(text.contains("group g0"), "{text}");
        assert!(text.contains("4321"), "{text}");
        assert!(text.contains("live,cordoned"), "{text}");
        // three live ranks at 0, 4321 and 0: the two figures differ
        assert!(text.contains("imbalance 4321"), "{text}");
        assert!(text.contains("barrier idle 8642 (66.7%)"), "{text}");
        // rank 1 carries the only load: a full bar on its line only
        let rank_line = |id: &str| {
            text.lines()
                .find(|l| l.trim_start_matches('│').starts_with(id) && l.contains("live"))
                .unwrap_or_else(|| panic!("no line for rank {id}:\n{text}"))
        };
        assert!(rank_line("1").contains('█') && rank_line("1").contains("4321"));
        assert!(!rank_line("0").contains('█') && !rank_line("2").contains('█'));
    }

    #[test]
    fn a_failed_refresh_is_shown() {
        let text = frame_text(&Err(anyhow::anyhow!("Unavailable: connection refused")));
        assert!(text.contains("refresh failed"), "{text}");
    }
}
