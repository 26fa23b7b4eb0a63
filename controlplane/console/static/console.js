// AdaFlash console: small conveniences only; every check that matters is on the server.
document.addEventListener("click", (ev) => {
  const button = ev.target.closest("button[type=submit]");
  if (!button || button.disabled) return;
  const form = button.form;
  if (button.hasAttribute("data-needs-reason")) {
    const reason = form.querySelector("[name=reason]");
    if (reason && !reason.value.trim()) {
      ev.preventDefault();
      reason.setCustomValidity("A reason is required for this action.");
      reason.reportValidity();
      reason.addEventListener("input", () => reason.setCustomValidity(""), { once: true });
      return;
    }
  }
  const question = button.getAttribute("data-confirm");
  if (question && !window.confirm(question)) ev.preventDefault();
});
