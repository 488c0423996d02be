#include <nanguard/observer_pause.h>

#include "detail/observer_slot.h"

namespace nanguard {

void pause_observers() { ++detail::observer_pauses; }

void resume_observers() {
  if (detail::observer_pauses > 0) --detail::observer_pauses;
}

bool observers_paused() { return detail::observer_pauses > 0; }

}  // namespace nanguard
